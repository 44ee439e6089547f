// NumaTopology is the host's NUMA layout as sysfs describes it: its nodes and the CPUs of each
// (<root>/devices/system/node/node<N>/cpulist), and the node a PCI device is attached to
// (<root>/bus/pci/devices/<bus id>/numa_node). tsd reads it once at start from a root that is a
// setting (`sysfs_root`, /sys by default), so tests can point it at a fake tree. With it the
// daemon puts a job's optimizer threads and host regions on the node of the job's GPU, whose PCI
// bus id the client sends; on a host of one node it places nothing (today's behaviour).
//
// Nothing read here is trusted blindly: every file is size-capped and parsed strictly, and a bus
// id from a client is validated and rewritten into its canonical form before it becomes a path.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tsd {

// A node and its CPUs (ascending; empty for a memory-only node).
struct NumaNode {
  int id = 0;
  std::vector<int> cpus;
};

// Where a job with a given GPU goes: `node` (-1: nowhere in particular) and, when no node could be
// chosen for a device, why not (for the daemon's log line).
struct NumaPlacement {
  int node = -1;
  std::string reason;
};

class NumaTopology final {
 public:
  // The largest node id and CPU id accepted (beyond them sysfs is not believed).
  static constexpr int kMaxNodes = 1024;
  static constexpr int kMaxCpus = 8192;

  // Reads the nodes under `sysfs_root`. NOT_FOUND when the tree has no node directory (a kernel
  // without NUMA, or a container hiding it); INVALID_ARGUMENT / DATA_LOSS when a file is missing
  // or malformed. Either way the caller places nothing.
  static absl::StatusOr<NumaTopology> Load(const std::string& sysfs_root);
  // A topology of the given nodes (tests, and a host without sysfs: one node of every CPU).
  static NumaTopology FromNodes(std::string sysfs_root, std::vector<NumaNode> nodes);

  const std::vector<NumaNode>& nodes() const { return nodes_; }
  // Placement means something only with two nodes or more.
  bool multi_node() const { return nodes_.size() > 1; }
  // The node `id`, or null.
  const NumaNode* FindNode(int id) const;
  const std::string& root() const { return root_; }

  // The node of the GPU at PCI address `bus_id` (as a client sent it). A malformed id is the
  // caller's error (INVALID_ARGUMENT, saying the expected form). An empty id (a CPU-only trainer),
  // a device sysfs does not list, an unreadable or malformed numa_node file, the kernel's -1 or a
  // node not in this topology all give node -1, the last four with a reason.
  absl::StatusOr<NumaPlacement> PlaceDevice(absl::string_view bus_id) const;

  // "0:0-7 1:8-15" (for the log and `tsctl status`).
  std::string Describe() const;

 private:
  std::string root_;
  std::vector<NumaNode> nodes_;  // ascending ids
};

// Parses a sysfs CPU list ("0-3,8,10-11\n"; empty means none) into ascending, distinct ids, each
// below `max_id`. INVALID_ARGUMENT, quoting the text, when it is not one.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, int max_id);

// Checks a PCI address from a client and returns it in sysfs's form, "dddd:bb:dd.f" in lower-case
// hex (a domain of up to 8 digits is accepted and printed with at least 4, so nvidia-smi's
// "00000000:C1:00.0" becomes "0000:c1:00.0"). INVALID_ARGUMENT, saying the expected form, else.
absl::StatusOr<std::string> CanonicalPciBusId(absl::string_view bus_id);

}  // namespace tsd
