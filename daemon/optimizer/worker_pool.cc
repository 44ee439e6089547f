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

namespace tsd {

WorkerPool::WorkerPool(int threads, bool pin, int nice) {
  if (threads < 1) threads = 1;
  // Each worker sets its own nice value (Linux keeps one per thread) before it takes work; the
  // constructor returns once all have, so nice_errno() is final.
  std::latch started(threads);
  std::vector<int> cpus;
  cpu_set_t allowed;
  if (pin && sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this, nice, &started] {
      if (nice != 0 &&
          setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice) != 0) {
        int expected = 0;
        nice_errno_.compare_exchange_strong(expected, errno);
      }
      started.count_down();
      Work();
    });
    if (!cpus.empty()) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[static_cast<size_t>(i) % cpus.size()], &one);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(one), &one);
    }
  }
  started.wait();
}

WorkerPool::~WorkerPool() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
  }
  work_cv_.NotifyAll();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<WorkerPool::Queue> WorkerPool::NewQueue() { return std::make_shared<Queue>(); }

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
  if (tasks.size() == 1) {
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

void WorkerPool::Work() {
  // Held except while a task runs (explicit Lock/Unlock rather than a scoped lock, so the
  // analysis follows the hand-over).
  mu_.Lock();
  for (;;) {
    while (!stopping_ && ready_.empty()) work_cv_.Wait(mu_);
    if (stopping_) {
      mu_.Unlock();
      return;
    }
    // Take one task from the queue at the front, then send that queue to the back: round robin.
    std::shared_ptr<Queue> q = ready_.front();
    ready_.pop_front();
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
