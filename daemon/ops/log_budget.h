// LogBudget bounds the log lines one client uid can make tsd write for one kind of event. Some
// events are a client's fault and cost it nothing to repeat (a garbage datagram after an attach
// gets an error reply and the session goes on), so without a bound a local user could make tsd
// write tens of thousands of lines a second: journald's per-service rate limit would then drop
// tsd's own lines for everyone, and the attacker's would hide everything else. Each uid gets
// `burst` lines per `window`; the lines held back are counted, and the first line written after
// them says how many there were (so nothing is silently lost from the record). The client still
// gets its error reply every time: only the log is bounded.
#pragma once

#include <sys/types.h>

#include <spdlog/spdlog.h>

#include <cstdint>
#include <map>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/mutex.h"

namespace tsd {

class LogBudget {
 public:
  LogBudget(int burst, absl::Duration window) : burst_(burst), window_(window) {}
  LogBudget(const LogBudget&) = delete;
  LogBudget& operator=(const LogBudget&) = delete;

  // Whether a line for `uid` may be written at `now`. When it may, `*held_back` gets the number of
  // lines of this uid held back since the last one written (to be logged with it), and is reset.
  bool Allow(uid_t uid, absl::Time now, uint64_t* held_back);

  // Writes a warning for `uid` now when its budget allows. `format` takes `args` and then the
  // count of lines held back before this one (it ends with `earlier_not_logged={}`).
  template <typename... Args>
  void Warn(uid_t uid, spdlog::format_string_t<Args..., uint64_t> format, Args&&... args) {
    uint64_t held_back = 0;
    if (Allow(uid, absl::Now(), &held_back)) {
      spdlog::warn(format, std::forward<Args>(args)..., uint64_t{held_back});
    }
  }

  // Uids with an entry (a test's view: entries of quiet uids are dropped as the map grows).
  size_t tracked() const;

 private:
  struct Entry {
    absl::Time window_start;
    int written = 0;
    uint64_t held_back = 0;
  };
  // Entries beyond which the quiet ones (window over, nothing held back) are dropped.
  static constexpr size_t kMaxQuietEntries = 256;

  const int burst_;
  const absl::Duration window_;
  mutable Mutex mu_;
  std::map<uid_t, Entry> by_uid_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tsd
