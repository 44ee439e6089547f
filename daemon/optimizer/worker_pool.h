// WorkerPool runs the optimizer's work on a fixed set of CPU threads shared by every job. Work
// arrives as small tasks (a chunk of one bucket) in per-job queues, and the workers take tasks
// from the queues in turn: a job with ten times the parameters gets no more than its turn, so it
// cannot starve a small one. A job's queue can be cancelled; `Cancel` returns once none of the
// job's tasks runs any more. Workers may run at a nice value above the trainers': the optimizer
// is throughput work, while a trainer's kernel-launching thread needs a CPU the moment it wakes.
// Within one queue, tasks may carry a priority (lower runs first; equal ones in submission order):
// a job's optimizer uses it to update buckets in the order the next forward needs them.
//
// On a host of several NUMA nodes the pool may be split by node: each worker belongs to a node
// and runs only on its CPUs, and a queue made for a node (the node of its job's GPU, where the
// job's regions are) is served by that node's workers only, so its updates read and write local
// memory. Queues of no node are served by every worker. With one node or none, nothing changes.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "daemon/memory/numa_topology.h"
#include "proto/mutex.h"

namespace tsd {

class WorkerPool final {
 public:
  class Queue;
  // `threads` workers (at least 1); with `pin`, worker i is pinned to the i-th allowed CPU; with
  // `nice` != 0 each worker sets its own nice value (see nice_errno()). `nodes` (two or more, each
  // with the CPUs the daemon may use there; nodes without CPUs are skipped) splits the workers
  // between the nodes in proportion to their CPUs, at least one per node, each confined to its
  // node's CPUs (with `pin`, to one of them).
  WorkerPool(int threads, bool pin, int nice = 0, const std::vector<NumaNode>& nodes = {});
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // A queue for one job; `node` >= 0 (a node this pool serves) keeps its tasks on that node's
  // workers, any other value lets every worker take them.
  std::shared_ptr<Queue> NewQueue(int node = -1);
  // True when the pool is split by node and has workers on `node`.
  bool ServesNode(int node) const;
  // Confines the calling thread to `node`'s CPUs (a job's dispatcher, which runs small updates
  // itself); does nothing for a node the pool does not serve.
  void PinCurrentThreadToNode(int node) const;
  // The node of each worker (-1 each when the pool is not split): for tests and the log.
  const std::vector<int>& worker_nodes() const { return worker_nodes_; }
  // Adds tasks to `queue`; they run in the order given, interleaved fairly with other queues.
  // Within the queue they go after every pending task of a `priority` <= theirs and before the
  // ones of a higher value (so with one priority for everything, the queue is first in, first out).
  void Submit(const std::shared_ptr<Queue>& queue, std::vector<std::function<void()>> tasks,
              uint64_t priority = 0) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the queue's pending tasks and waits for its running ones; later Submits are ignored.
  void Cancel(const std::shared_ptr<Queue>& queue) ABSL_LOCKS_EXCLUDED(mu_);
  int threads() const { return static_cast<int>(workers_.size()); }
  // 0, or the errno of the first worker that could not set its nice value (e.g. EACCES for a
  // negative one without CAP_SYS_NICE); known once the constructor returned.
  int nice_errno() const { return nice_errno_.load(); }

  // A job's tasks. Its fields belong to the pool: they are read and written only under the
  // pool's mu_ (an annotation cannot name another object's mutex, so WorkerPool's methods that
  // touch them are the ones annotated).
  class Queue {
   private:
    friend class WorkerPool;
    std::deque<std::pair<uint64_t, std::function<void()>>> tasks;  // sorted by priority (stable)
    int running = 0;
    bool cancelled = false;
    bool listed = false;  // in the pool's round-robin list
    int node = -1;        // only this node's workers take its tasks (-1: any worker)
  };

 private:
  void Work(int node) ABSL_LOCKS_EXCLUDED(mu_);
  // The first queue in round-robin order a worker of `node` may serve, taken off the list; null
  // when there is none.
  std::shared_ptr<Queue> TakeQueueLocked(int node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Mutex mu_;
  CondVar work_cv_;  // tasks arrived, or stopping
  CondVar idle_cv_;  // a task finished (for Cancel)
  // Queues with tasks, in round-robin order.
  std::list<std::shared_ptr<Queue>> ready_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<int> nice_errno_{0};
  std::vector<std::pair<int, std::vector<int>>> node_cpus_;  // the nodes served, with their CPUs
  std::vector<int> worker_nodes_;
  std::vector<std::thread> workers_;
};

}  // namespace tsd
