// The optimizer's worker pool: fair turns between jobs, and cancellation that waits for running
// work and drops the rest.
#include "daemon/optimizer/worker_pool.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace tsd {
namespace {

// One worker, a big job with 40 queued chunks and a small job with 2 submitted after it: the
// small job's chunks run within its next two turns, not after the big job's backlog.
TEST(WorkerPool, ASmallJobIsNotStarvedByABigOne) {
  WorkerPool pool(1, false);
  auto big = pool.NewQueue(), small = pool.NewQueue();
  std::mutex mu;
  std::vector<char> order;
  std::atomic<bool> release{false};
  // Hold the worker on a first task so both queues are full when it starts taking turns.
  pool.Submit(big, {[&] {
                while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
              }});
  std::vector<std::function<void()>> big_tasks, small_tasks;
  for (int i = 0; i < 40; ++i)
    big_tasks.push_back([&] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back('B');
    });
  for (int i = 0; i < 2; ++i)
    small_tasks.push_back([&] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back('s');
    });
  pool.Submit(big, std::move(big_tasks));
  pool.Submit(small, std::move(small_tasks));
  release.store(true);
  for (;;) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (order.size() == 42) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> l(mu);
  // Round robin: the two queues alternate while both have work (BsBs... or sBsB...), so both of
  // the small job's chunks run among the first four, ahead of the big job's backlog.
  const std::string seen(order.begin(), order.end());
  EXPECT_EQ(std::count(seen.begin(), seen.begin() + 4, 's'), 2) << seen;
  EXPECT_TRUE(seen.substr(0, 4) == "BsBs" || seen.substr(0, 4) == "sBsB") << seen;
}

// Workers run at the configured nice value (each sets its own: Linux keeps one per thread); the
// thread that made the pool keeps its own.
TEST(WorkerPool, WorkersRunAtTheirNiceValue) {
  errno = 0;
  const int own = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  ASSERT_EQ(errno, 0);
  const int nice = std::min(own + 7, 19);
  WorkerPool pool(3, false, nice);
  EXPECT_EQ(pool.nice_errno(), 0);
  auto q = pool.NewQueue();
  std::mutex mu;
  std::vector<int> seen;
  std::atomic<int> left{12};
  std::vector<std::function<void()>> tasks;
  for (int i = 0; i < 12; ++i) {
    tasks.push_back([&] {
      const int p = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(p);
      --left;
    });
  }
  pool.Submit(q, std::move(tasks));
  while (left.load() > 0) std::this_thread::yield();
  for (int p : seen) EXPECT_EQ(p, nice);
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))), own);
}

TEST(WorkerPool, CancelDropsPendingAndWaitsForRunning) {
  WorkerPool pool(2, false);
  auto q = pool.NewQueue();
  std::atomic<int> ran{0};
  std::atomic<bool> running{false}, finished{false};
  std::vector<std::function<void()>> tasks;
  tasks.push_back([&] {
    running.store(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    finished.store(true);
  });
  for (int i = 0; i < 1000; ++i)
    tasks.push_back([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++ran;
    });
  pool.Submit(q, std::move(tasks));
  while (!running.load()) std::this_thread::yield();
  pool.Cancel(q);
  EXPECT_TRUE(finished.load()) << "Cancel must wait for the running task";
  const int after_cancel = ran.load();
  EXPECT_LT(after_cancel, 1000);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(ran.load(), after_cancel) << "no task of a cancelled queue may start";
  pool.Submit(q, {[&] { ++ran; }});  // ignored
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ran.load(), after_cancel);
}

// One worker held on a first task while tasks of priorities 5, 2, 9, 2 and 0 queue up: they run
// lowest priority first, equal ones in submission order (the optimizer's forward order).
TEST(WorkerPool, TasksRunByPriorityThenInSubmissionOrder) {
  WorkerPool pool(1, false);
  auto q = pool.NewQueue();
  std::mutex mu;
  std::vector<int> order;
  std::atomic<bool> started{false}, release{false};
  pool.Submit(q, {[&] {
                started.store(true);
                while (!release.load()) std::this_thread::yield();
              }});
  while (!started.load()) std::this_thread::yield();
  const std::vector<std::pair<uint64_t, int>> submits = {{5, 1}, {2, 2}, {9, 3}, {2, 4}, {0, 5}};
  for (const auto& [priority, id] : submits) {
    std::vector<std::function<void()>> tasks;
    for (int k = 0; k < 2; ++k) {
      tasks.push_back([&mu, &order, id = id * 10 + k] {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(id);
      });
    }
    pool.Submit(q, std::move(tasks), priority);
  }
  release.store(true);
  for (int i = 0; i < 2000; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (order.size() == 10) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(order, (std::vector<int>{50, 51, 20, 21, 40, 41, 10, 11, 30, 31}));
}

}  // namespace
}  // namespace tsd
