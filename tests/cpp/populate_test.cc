// PopulateMapping: every page of a fresh memfd mapping is faulted in (the mapping's Rss is its
// size), by several threads, contents unchanged; Region::Create uses it.
#include "daemon/memory/populate.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "daemon/memory/region.h"
#include "gtest/gtest.h"

namespace tsd {
namespace {

// The Rss of the mapping that starts at `p`, in bytes, from /proc/self/smaps (-1 if not found).
int64_t MappingRss(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  char start[32];
  std::snprintf(start, sizeof(start), "%lx-", reinterpret_cast<unsigned long>(p));
  std::string line;
  bool in = false;
  while (std::getline(smaps, line)) {
    if (line.rfind(start, 0) == 0) {
      in = true;
    } else if (in && line.rfind("Rss:", 0) == 0) {
      std::istringstream is(line.substr(4));
      int64_t kb = 0;
      is >> kb;
      return kb * 1024;
    }
  }
  return -1;
}

// Every page of [p, p + bytes) is mapped: its Rss is the size, less at most 1% (a page that the
// kernel is migrating at the moment smaps is read, for compaction, is not counted; CI saw 4 pages
// of 300 MiB missing once, under memory pressure). A mapping that was not faulted in has an Rss
// near 0.
void ExpectFaultedIn(const void* p, uint64_t bytes, const std::string& what) {
  const int64_t rss = MappingRss(p);
  EXPECT_GE(rss, static_cast<int64_t>(bytes - bytes / 100)) << what;
  EXPECT_LE(rss, static_cast<int64_t>(bytes)) << what;
}

// A fallocated memfd of `bytes`, mapped shared without populating (as Region::Create maps it).
struct Mapping {
  explicit Mapping(uint64_t bytes) : bytes(bytes) {
    fd = memfd_create("populate_test", MFD_CLOEXEC);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(fallocate(fd, 0, 0, static_cast<off_t>(bytes)), 0);
    data = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    EXPECT_NE(data, MAP_FAILED);
  }
  ~Mapping() {
    munmap(data, bytes);
    close(fd);
  }
  uint64_t bytes;
  int fd = -1;
  char* data = nullptr;
};

TEST(Populate, FaultsInEveryPageWithSeveralThreadsAndKeepsTheContents) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t bytes = (300ull << 20) + 3 * page;  // chunks of 64 MiB and a short tail
  Mapping m(bytes);
  m.data[0] = 7;
  m.data[bytes - 1] = 9;
  const int64_t before = MappingRss(m.data);
  ASSERT_GE(before, 0);
  EXPECT_LT(before, static_cast<int64_t>(bytes / 2));  // nothing faulted in yet but the two pages
  ASSERT_TRUE(PopulateMapping(m.data, bytes, 4).ok());
  ExpectFaultedIn(m.data, bytes, "4 threads");
  EXPECT_EQ(m.data[0], 7);
  EXPECT_EQ(m.data[bytes - 1], 9);
  EXPECT_EQ(m.data[bytes / 2], 0);
}

TEST(Populate, OneThreadAndMoreThreadsThanChunksWork) {
  const uint64_t bytes = 8ull << 20;
  Mapping one(bytes), many(bytes);
  ASSERT_TRUE(PopulateMapping(one.data, bytes, 1).ok());
  ASSERT_TRUE(PopulateMapping(many.data, bytes, 64).ok());  // one chunk: one thread does it
  ExpectFaultedIn(one.data, bytes, "1 thread");
  ExpectFaultedIn(many.data, bytes, "64 threads asked");
  EXPECT_TRUE(PopulateMapping(one.data, 0).ok());
}

TEST(Populate, ThreadsFollowTheSizeAndTheCpus) {
  EXPECT_EQ(PopulateThreads(0), 1);
  EXPECT_EQ(PopulateThreads(100ull << 20), 1);
  const int cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_GE(PopulateThreads(64ull << 30), 1);
  EXPECT_LE(PopulateThreads(64ull << 30), std::min(16, cpus));
  EXPECT_LE(PopulateThreads(512ull << 20), 2);
}

TEST(Populate, AFailureNamesTheRangeAndTheError) {
  const uint64_t bytes = 4ull << 20;
  Mapping m(bytes);
  // Read-only: faulting the pages in for writing cannot succeed.
  void* ro = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, m.fd, 0);
  ASSERT_NE(ro, MAP_FAILED);
  if (!PopulateWriteSupported()) {
    munmap(ro, bytes);
    GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (the fallback writes each page)";
  }
  absl::Status s = PopulateMapping(ro, bytes, 2);
  munmap(ro, bytes);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("faulting in the pages of 4 MiB at offset 0 failed: "),
            std::string::npos)
      << s.message();
}

TEST(Populate, RegionsAreFaultedInWhenCreated) {
  const uint64_t bytes = 320ull << 20;
  auto r = Region::Create(1, "populated", bytes, /*lock=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectFaultedIn((*r)->data(), bytes, "region");
  EXPECT_EQ(static_cast<const char*>((*r)->data())[bytes - 1], 0);
}

}  // namespace
}  // namespace tsd
