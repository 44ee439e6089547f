#include "daemon/memory/numa_memory.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tsd {
namespace {

// The kernel reads `maxnode - 1` bits of a mask (an old off-by-one every caller honours).
constexpr unsigned long kMaxNodeBits = 1024;

long SetMempolicy(int mode, const unsigned long* mask, unsigned long maxnode) {
  return syscall(SYS_set_mempolicy, mode, mask, maxnode);
}

long GetMempolicy(int* mode, unsigned long* mask, unsigned long maxnode, const void* addr,
                  unsigned long flags) {
  return syscall(SYS_get_mempolicy, mode, mask, maxnode, addr, flags);
}

}  // namespace

ScopedPreferredNode::ScopedPreferredNode(int node) {
  if (node < 0) return;
  if (static_cast<unsigned long>(node) >= kMaxNodeBits) {
    status_ = absl::InvalidArgumentError(absl::StrCat("NUMA node ", node, " is out of range"));
    return;
  }
  if (GetMempolicy(&old_mode_, old_mask_, kMaxNodeBits + 1, nullptr, 0) != 0) {
    status_ = absl::InternalError(absl::StrCat("get_mempolicy failed: ", std::strerror(errno)));
    return;
  }
  unsigned long mask[kMaskWords] = {};
  mask[node / 64] = 1UL << (node % 64);
  if (SetMempolicy(MPOL_PREFERRED, mask, kMaxNodeBits + 1) != 0) {
    status_ = absl::FailedPreconditionError(
        absl::StrCat("the kernel refused to prefer NUMA node ", node, ": ", std::strerror(errno)));
    return;
  }
  active_ = true;
}

ScopedPreferredNode::~ScopedPreferredNode() {
  if (!active_) return;
  // MPOL_DEFAULT takes no mask; the others get back the nodes they had.
  if (old_mode_ == MPOL_DEFAULT) {
    SetMempolicy(MPOL_DEFAULT, nullptr, 0);
  } else {
    SetMempolicy(old_mode_, old_mask_, kMaxNodeBits + 1);
  }
}

absl::StatusOr<int> NodeOfPage(const void* addr) {
  int node = -1;
  if (GetMempolicy(&node, nullptr, 0, addr, MPOL_F_NODE | MPOL_F_ADDR) != 0) {
    return absl::InternalError(
        absl::StrCat("get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR) failed: ", std::strerror(errno)));
  }
  return node;
}

absl::StatusOr<int> ThreadMemoryPolicyMode() {
  int mode = 0;
  unsigned long mask[1024 / 64 + 1] = {};
  if (GetMempolicy(&mode, mask, kMaxNodeBits + 1, nullptr, 0) != 0) {
    return absl::InternalError(absl::StrCat("get_mempolicy failed: ", std::strerror(errno)));
  }
  return mode;
}

}  // namespace tsd
