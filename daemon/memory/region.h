// A Region is one block of host memory the daemon lends to a job: an unnamed memfd, sized,
// populated (every page allocated up front, so a client can never take a SIGBUS for lack of
// memory), sealed against shrinking and growing (so no client can make the daemon fault on its
// own mapping), mapped into the daemon and, when the pool is locked, mlock()ed. The daemon never
// reuses a memfd: on destruction the pages are punched out of it (returned to the kernel, which
// zero-fills any page before giving it out again), even if a client still maps the descriptor.
// A region may be placed on a NUMA node (daemon/memory/numa_memory.h): its pages are then
// allocated there while the node has room. Parts of it may be released early (Release: the
// daemon's optimizer giving back the state of buckets that moved out of it); the region keeps its
// size, and what it still holds is bytes() less released_bytes().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "proto/mutex.h"

namespace tsd {

class Region final {
 public:
  // Creates a region of `bytes` (a multiple of the page size). `lock` asks for mlock().
  // `numa_node` >= 0 prefers that node for its pages; when the kernel refuses the node the region
  // is made without placement, numa_node() is -1 and numa_error() says why.
  static absl::StatusOr<std::unique_ptr<Region>> Create(uint64_t id, std::string name,
                                                        uint64_t bytes, bool lock,
                                                        int numa_node = -1);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  uint64_t id() const { return id_; }
  const std::string& name() const { return name_; }
  uint64_t bytes() const { return bytes_; }
  bool locked() const { return locked_; }
  void* data() const { return data_; }
  // The memfd, owned by the region. Dup it before handing it out.
  int fd() const { return fd_; }
  // The NUMA node its pages were asked from (-1: none), and why a node asked for was not used.
  int numa_node() const { return numa_node_; }
  const std::string& numa_error() const { return numa_error_; }

  // Returns the whole pages inside [offset, offset + bytes) to the kernel: a hole punched in the
  // memfd, so they leave every mapping at once (a client mapping that touches them again gets
  // fresh zero pages, charged to itself; the daemon must not touch them again). Returns the bytes
  // newly released: pages released before count once. INVALID_ARGUMENT past the region's end.
  absl::StatusOr<uint64_t> Release(uint64_t offset, uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes released so far (a multiple of the page size).
  uint64_t released_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  // What the region still holds: bytes() less released_bytes() (what its ledger charge is).
  uint64_t held_bytes() const { return bytes_ - released_bytes(); }

 private:
  Region(uint64_t id, std::string name, uint64_t bytes)
      : id_(id), name_(std::move(name)), bytes_(bytes) {}

  const uint64_t id_;
  const std::string name_;
  const uint64_t bytes_;
  int fd_ = -1;
  void* data_ = nullptr;
  bool locked_ = false;
  int numa_node_ = -1;
  std::string numa_error_;
  mutable Mutex mu_;
  // The released page ranges, [begin, end) by begin, merged.
  std::map<uint64_t, uint64_t> released_ ABSL_GUARDED_BY(mu_);
  uint64_t released_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tsd
