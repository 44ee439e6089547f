#include "daemon/memory/region.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "daemon/memory/numa_memory.h"
#include "daemon/memory/populate.h"
#include "proto/wire.h"

namespace tsd {

absl::StatusOr<std::unique_ptr<Region>> Region::Create(uint64_t id, std::string name,
                                                       uint64_t bytes, bool lock, int numa_node) {
  if (bytes == 0 || bytes % wire::kPageBytes != 0) {
    return absl::InternalError(
        absl::StrCat("region size ", bytes, " is not a positive page multiple"));
  }
  std::unique_ptr<Region> r(new Region(id, std::move(name), bytes));
  const std::string label = absl::StrCat("tsd:", r->name_);
  r->fd_ = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (r->fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create failed: ", std::strerror(errno)));
  }
  const off_t size = static_cast<off_t>(bytes);
  if (ftruncate(r->fd_, size) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate(", bytes, ") failed: ", std::strerror(errno)));
  }
  // The pages are allocated below (fallocate, then the mapping's populate) under this thread's
  // memory policy: the node's while `place` lives.
  ScopedPreferredNode place(numa_node);
  if (place.active()) {
    r->numa_node_ = numa_node;
  } else if (!place.status().ok()) {
    r->numa_error_ = std::string(place.status().message());
  }
  // Allocate every page now: running out of memory is an error here, never a SIGBUS later.
  if (fallocate(r->fd_, 0, 0, size) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("the host could not provide ",
                                                     wire::FormatBytes(bytes), " for region '",
                                                     r->name_, "': ", std::strerror(errno)));
  }
  if (fcntl(r->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sealing the memfd failed: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", wire::FormatBytes(bytes), " failed: ", std::strerror(errno)));
  }
  r->data_ = p;
  // The pages' zero-fill, on several threads (they inherit this thread's NUMA policy).
  if (absl::Status s = PopulateMapping(p, bytes); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("region '", r->name_, "': ", s.message()));
  }
  if (lock) {
    if (mlock(p, bytes) != 0) {
      return absl::ResourceExhaustedError(
          absl::StrCat("mlock of ", wire::FormatBytes(bytes), " failed: ", std::strerror(errno),
                       "; raise the daemon's memlock limit (LimitMEMLOCK=infinity)"));
    }
    r->locked_ = true;
  }
  return r;
}

absl::StatusOr<uint64_t> Region::Release(uint64_t offset, uint64_t bytes) {
  if (offset > bytes_ || bytes > bytes_ - offset) {
    return absl::InvalidArgumentError(absl::StrCat("release of [", offset, ", +", bytes,
                                                   ") passes region '", name_, "' (", bytes_,
                                                   " bytes)"));
  }
  // Whole pages only: a page shared with memory still in use stays.
  const uint64_t page = wire::kPageBytes;
  const uint64_t begin = (offset + page - 1) / page * page;
  const uint64_t end = (offset + bytes) / page * page;
  if (end <= begin) return 0;
  if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(begin),
                static_cast<off_t>(end - begin)) != 0) {
    return absl::InternalError(absl::StrCat("punching [", begin, ", ", end, ") out of region '",
                                            name_, "' failed: ", std::strerror(errno)));
  }
  MutexLock lock(mu_);
  // Merge [begin, end) into the released ranges, counting only what none of them covered.
  uint64_t lo = begin, hi = end, covered = 0;
  auto it = released_.upper_bound(begin);
  if (it != released_.begin() && std::prev(it)->second >= begin) --it;
  while (it != released_.end() && it->first <= end) {
    covered += std::min(it->second, end) - std::max(it->first, begin);
    lo = std::min(lo, it->first);
    hi = std::max(hi, it->second);
    it = released_.erase(it);
  }
  released_.emplace(lo, hi);
  const uint64_t fresh = (end - begin) - covered;
  released_bytes_ += fresh;
  return fresh;
}

uint64_t Region::released_bytes() const {
  MutexLock lock(mu_);
  return released_bytes_;
}

Region::~Region() {
  if (data_ != nullptr) {
    if (locked_) munlock(data_, bytes_);
    munmap(data_, bytes_);
  }
  if (fd_ >= 0) {
    // Return the pages now, even while a client still maps the descriptor; they come back
    // zero-filled if anyone touches them again.
    fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(bytes_));
    close(fd_);
  }
}

}  // namespace tsd
