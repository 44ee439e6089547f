#include "daemon/optimizer/worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <iterator>
#include <latch>

#include "daemon/memory/cpu_affinity.h"

namespace tsd {

namespace {

// How many of `threads` workers each node gets: in proportion to its CPUs (largest remainders
// take the rest), and at least one, so every node's jobs have a worker.
std::vector<int> SplitByCpus(int threads,
                             const std::vector<std::pair<int, std::vector<int>>>& nodes) {
  size_t total = 0;
  for (const auto& n : nodes) total += n.second.size();
  std::vector<int> counts(nodes.size(), 0);
  std::vector<std::pair<size_t, size_t>> remainders;  // (remainder, node index)
  int given = 0;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const size_t share = static_cast<size_t>(threads) * nodes[k].second.size();
    counts[k] = static_cast<int>(share / total);
    given += counts[k];
    remainders.emplace_back(share % total, k);
  }
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = 0; given < threads && i < remainders.size(); ++i, ++given) {
    ++counts[remainders[i].second];
  }
  for (int& c : counts) c = std::max(c, 1);
  return counts;
}

void SetAffinity(pthread_t thread, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  if (CPU_COUNT(&set) > 0) pthread_setaffinity_np(thread, sizeof(set), &set);
}

}  // namespace

WorkerPool::WorkerPool(int threads, bool pin, int nice, const std::vector<NumaNode>& nodes) {
  if (threads < 1) threads = 1;
  if (nodes.size() > 1) {
    for (const NumaNode& n : nodes) {
      if (!n.cpus.empty()) node_cpus_.emplace_back(n.id, n.cpus);
    }
    if (node_cpus_.size() < 2) node_cpus_.clear();  // one node with CPUs: nothing to split
  }
  // The node and CPUs of each worker: split by node, or (one node) every allowed CPU.
  std::vector<std::vector<int>> affinity;
  if (!node_cpus_.empty()) {
    const std::vector<int> counts = SplitByCpus(threads, node_cpus_);
    for (size_t k = 0; k < node_cpus_.size(); ++k) {
      const std::vector<int>& cpus = node_cpus_[k].second;
      for (int j = 0; j < counts[k]; ++j) {
        worker_nodes_.push_back(node_cpus_[k].first);
        affinity.push_back(pin ? std::vector<int>{cpus[static_cast<size_t>(j) % cpus.size()]}
                               : cpus);
      }
    }
    threads = static_cast<int>(worker_nodes_.size());
  } else {
    const std::vector<int> cpus = pin ? AllowedCpus() : std::vector<int>{};
    for (int i = 0; i < threads; ++i) {
      worker_nodes_.push_back(-1);
      affinity.push_back(cpus.empty()
                             ? std::vector<int>{}
                             : std::vector<int>{cpus[static_cast<size_t>(i) % cpus.size()]});
    }
  }
  // Each worker sets its own nice value (Linux keeps one per thread) before it takes work; the
  // constructor returns once all have, so nice_errno() is final.
  std::latch started(threads);
  for (int i = 0; i < threads; ++i) {
    const int node = worker_nodes_[static_cast<size_t>(i)];
    workers_.emplace_back([this, nice, node, &started] {
      if (nice != 0 &&
          setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice) != 0) {
        int expected = 0;
        nice_errno_.compare_exchange_strong(expected, errno);
      }
      started.count_down();
      Work(node);
    });
    if (!affinity[static_cast<size_t>(i)].empty()) {
      SetAffinity(workers_.back().native_handle(), affinity[static_cast<size_t>(i)]);
    }
  }
  started.wait();
}

bool WorkerPool::ServesNode(int node) const {
  for (const auto& n : node_cpus_) {
    if (n.first == node) return true;
  }
  return false;
}

void WorkerPool::PinCurrentThreadToNode(int node) const {
  for (const auto& n : node_cpus_) {
    if (n.first == node) SetAffinity(pthread_self(), n.second);
  }
}

WorkerPool::~WorkerPool() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  work_cv_.NotifyAll();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<WorkerPool::Queue> WorkerPool::NewQueue(int node) {
  auto q = std::make_shared<Queue>();
  q->node = ServesNode(node) ? node : -1;
  return q;
}

void WorkerPool::Submit(const std::shared_ptr<Queue>& queue,
                        std::vector<std::function<void()>> tasks, uint64_t priority) {
  if (tasks.empty()) return;
  {
    MutexLock lock(mu_);
    if (queue->cancelled) return;
    // After the last pending task whose priority is <= this one's (the deque stays sorted).
    auto at = std::upper_bound(queue->tasks.begin(), queue->tasks.end(), priority,
                               [](uint64_t p, const std::pair<uint64_t, std::function<void()>>& t) {
                                 return p < t.first;
                               });
    std::vector<std::pair<uint64_t, std::function<void()>>> keyed;
    keyed.reserve(tasks.size());
    for (auto& t : tasks) keyed.emplace_back(priority, std::move(t));
    queue->tasks.insert(at, std::make_move_iterator(keyed.begin()),
                        std::make_move_iterator(keyed.end()));
    if (!queue->listed) {
      queue->listed = true;
      ready_.push_back(queue);
    }
  }
  if (tasks.size() == 1 && node_cpus_.empty()) {
    // Any worker may take it. (Split by node, a worker woken for another node's task would go
    // back to sleep and the task would wait: wake them all.)
    work_cv_.NotifyOne();
  } else {
    work_cv_.NotifyAll();
  }
}

void WorkerPool::Cancel(const std::shared_ptr<Queue>& queue) {
  MutexLock lock(mu_);
  queue->cancelled = true;
  queue->tasks.clear();
  if (queue->listed) {
    ready_.remove(queue);
    queue->listed = false;
  }
  while (queue->running != 0) idle_cv_.Wait(mu_);
}

std::shared_ptr<WorkerPool::Queue> WorkerPool::TakeQueueLocked(int node) {
  for (auto it = ready_.begin(); it != ready_.end(); ++it) {
    if ((*it)->node < 0 || (*it)->node == node) {
      std::shared_ptr<Queue> q = std::move(*it);
      ready_.erase(it);
      return q;
    }
  }
  return nullptr;
}

void WorkerPool::Work(int node) {
  // Held except while a task runs (explicit Lock/Unlock rather than a scoped lock, so the
  // analysis follows the hand-over).
  mu_.Lock();
  for (;;) {
    std::shared_ptr<Queue> q;
    while (!stopping_ && (q = TakeQueueLocked(node)) == nullptr) work_cv_.Wait(mu_);
    if (stopping_) {
      mu_.Unlock();
      return;
    }
    // Take one task from the first queue this worker may serve, then send that queue to the
    // back: round robin.
    std::function<void()> task = std::move(q->tasks.front().second);
    q->tasks.pop_front();
    if (!q->tasks.empty()) {
      ready_.push_back(q);
    } else {
      q->listed = false;
    }
    ++q->running;
    mu_.Unlock();
    task();
    mu_.Lock();
    --q->running;
    if (q->cancelled && q->running == 0) idle_cv_.NotifyAll();
  }
}

}  // namespace tsd
