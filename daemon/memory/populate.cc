#include "daemon/memory/populate.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/memory/cpu_affinity.h"
#include "proto/wire.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older headers lack it
#endif

namespace tsd {
namespace {

constexpr uint64_t kChunkBytes = 64ull << 20;  // what one thread takes at a time
constexpr uint64_t kBytesPerThread = 256ull << 20;
constexpr int kMaxThreads = 16;

// Faults [p, p + n) in for writing: MADV_POPULATE_WRITE, or a read and a write of the same byte
// in every page where the kernel does not know it. Returns 0 or an errno.
int PopulateChunk(char* p, uint64_t n) {
  if (PopulateWriteSupported()) return madvise(p, n, MADV_POPULATE_WRITE) == 0 ? 0 : errno;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t off = 0; off < n; off += page) {
    volatile char* c = p + off;
    *c = *c;
  }
  return 0;
}

}  // namespace

bool PopulateWriteSupported() {
  // EINVAL also means a range without write permission, so ask once, on a page of our own.
  static const bool supported = [] {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    const bool ok = madvise(p, page, MADV_POPULATE_WRITE) == 0;
    munmap(p, page);
    return ok;
  }();
  return supported;
}

int PopulateThreads(uint64_t bytes) {
  const int cpus = AllowedCpuCount();
  const uint64_t wanted = std::max<uint64_t>(1, bytes / kBytesPerThread);
  return static_cast<int>(std::min<uint64_t>({wanted, static_cast<uint64_t>(cpus), kMaxThreads}));
}

absl::Status PopulateMapping(void* data, uint64_t bytes, int threads) {
  if (bytes == 0) return absl::OkStatus();
  if (threads <= 0) threads = PopulateThreads(bytes);
  char* base = static_cast<char*>(data);
  const uint64_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
  threads = static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(threads), chunks));
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  uint64_t failed_at = 0;
  int failed_errno = 0;
  auto work = [&] {
    for (uint64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
      const uint64_t off = i * kChunkBytes;
      if (const int e = PopulateChunk(base + off, std::min(kChunkBytes, bytes - off)); e != 0) {
        std::lock_guard<std::mutex> lock(mu);
        if (failed_errno == 0) {
          failed_errno = e;
          failed_at = off;
        }
        next.store(chunks);  // the others stop at their next chunk
        return;
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (failed_errno != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("faulting in the pages of ", wire::FormatBytes(bytes), " at offset ",
                     failed_at, " failed: ", std::strerror(failed_errno)));
  }
  return absl::OkStatus();
}

}  // namespace tsd
