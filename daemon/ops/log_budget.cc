#include "daemon/ops/log_budget.h"

#include <iterator>

namespace tsd {

bool LogBudget::Allow(uid_t uid, absl::Time now, uint64_t* held_back) {
  MutexLock lock(mu_);
  if (by_uid_.size() > kMaxQuietEntries && by_uid_.find(uid) == by_uid_.end()) {
    for (auto it = by_uid_.begin(); it != by_uid_.end();) {
      const bool quiet = now - it->second.window_start >= window_ && it->second.held_back == 0;
      it = quiet ? by_uid_.erase(it) : std::next(it);
    }
  }
  auto [it, fresh] = by_uid_.try_emplace(uid);
  Entry& e = it->second;
  if (fresh || now - e.window_start >= window_) {
    e.window_start = now;
    e.written = 0;
  }
  if (e.written >= burst_) {
    ++e.held_back;
    return false;
  }
  ++e.written;
  *held_back = e.held_back;
  e.held_back = 0;
  return true;
}

size_t LogBudget::tracked() const {
  MutexLock lock(mu_);
  return by_uid_.size();
}

}  // namespace tsd
