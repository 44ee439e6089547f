// Placing host memory on a NUMA node. A region's pages are allocated by fallocate() on its memfd,
// and the kernel allocates a memfd's pages under the allocating thread's memory policy (a shmem
// file without a policy of its own follows the task's). ScopedPreferredNode sets that policy to
// MPOL_PREFERRED for one node for as long as it lives and then restores the thread's previous
// one, so Region::Create puts a job's region on the node of the job's GPU and changes nothing
// else. "Preferred", not "bind": when the node is full the pages come from another node, as they
// would without placement, instead of the allocation failing.
//
// The two system calls are made directly (they are what libnuma's wrappers call), so tsd needs
// no extra library.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tsd {

class ScopedPreferredNode final {
 public:
  // `node` < 0 does nothing. When the kernel refuses the node (it has no such node, or the
  // daemon's cpuset excludes it) nothing changes and status() says why.
  explicit ScopedPreferredNode(int node);
  ~ScopedPreferredNode();
  ScopedPreferredNode(const ScopedPreferredNode&) = delete;
  ScopedPreferredNode& operator=(const ScopedPreferredNode&) = delete;

  // OK when the policy was set (or nothing was asked); else the kernel's refusal.
  const absl::Status& status() const { return status_; }
  bool active() const { return active_; }

 private:
  static constexpr int kMaskWords = 1024 / 64 + 1;
  absl::Status status_;
  bool active_ = false;
  int old_mode_ = 0;
  unsigned long old_mask_[kMaskWords] = {};
};

// The node of the (resident) page at `addr`.
absl::StatusOr<int> NodeOfPage(const void* addr);
// The calling thread's memory policy mode (MPOL_DEFAULT, MPOL_PREFERRED, ...).
absl::StatusOr<int> ThreadMemoryPolicyMode();

}  // namespace tsd
