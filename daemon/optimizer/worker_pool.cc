#include "daemon/optimizer/worker_pool.h"

#include <pthread.h>
#include <sched.h>

namespace tsd {

WorkerPool::WorkerPool(int threads, bool pin) {
  if (threads < 1) threads = 1;
  std::vector<int> cpus;
  cpu_set_t allowed;
  if (pin && sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { Work(); });
    if (!cpus.empty()) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpus[static_cast<size_t>(i) % cpus.size()], &one);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(one), &one);
    }
  }
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
