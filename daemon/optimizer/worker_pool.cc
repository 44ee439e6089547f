#include "daemon/optimizer/worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
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
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::shared_ptr<WorkerPool::Queue> WorkerPool::NewQueue() { return std::make_shared<Queue>(); }

void WorkerPool::Submit(const std::shared_ptr<Queue>& queue,
                        std::vector<std::function<void()>> tasks) {
  if (tasks.empty()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue->cancelled) return;
    for (auto& t : tasks) queue->tasks.push_back(std::move(t));
    if (!queue->listed) {
      queue->listed = true;
      ready_.push_back(queue);
    }
  }
  if (tasks.size() == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
}

void WorkerPool::Cancel(const std::shared_ptr<Queue>& queue) {
  std::unique_lock<std::mutex> lock(mu_);
  queue->cancelled = true;
  queue->tasks.clear();
  if (queue->listed) {
    ready_.remove(queue);
    queue->listed = false;
  }
  idle_cv_.wait(lock, [&] { return queue->running == 0; });
}

void WorkerPool::Work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
    if (stopping_) return;
    // Take one task from the queue at the front, then send that queue to the back: round robin.
    std::shared_ptr<Queue> q = ready_.front();
    ready_.pop_front();
    std::function<void()> task = std::move(q->tasks.front());
    q->tasks.pop_front();
    if (!q->tasks.empty()) {
      ready_.push_back(q);
    } else {
      q->listed = false;
    }
    ++q->running;
    lock.unlock();
    task();
    lock.lock();
    --q->running;
    if (q->cancelled && q->running == 0) idle_cv_.notify_all();
  }
}

}  // namespace tsd
