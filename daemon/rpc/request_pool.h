// RequestPool: a few threads that serve side-socket requests, so that a slow request (populating
// a large region, saving a large optimizer state) never holds up the side server's poll loop, and
// with it every other client's attach. Tasks run in the order they were submitted; Stop() lets
// the running and queued tasks finish, then joins the threads.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "proto/mutex.h"

namespace tsd {

class RequestPool final {
 public:
  explicit RequestPool(int threads);
  ~RequestPool();  // Stop()
  RequestPool(const RequestPool&) = delete;
  RequestPool& operator=(const RequestPool&) = delete;

  // Queues `task`; false (and `task` is dropped) once Stop() was called.
  bool Submit(std::function<void()> task);
  // Runs what is queued, then joins the threads. Idempotent.
  void Stop();

 private:
  void Run();

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // set in the constructor, joined by Stop()
};

}  // namespace tsd
