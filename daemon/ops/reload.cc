#include "daemon/ops/reload.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/memory/memlock.h"
#include "daemon/ops/logging.h"
#include "daemon/ops/settings.h"
#include "proto/wire.h"

namespace tsd {

const std::vector<absl::string_view>& Reloader::LiveKeys() {
  static const auto* keys =
      new std::vector<absl::string_view>{"log_level", "pool_size", "max_job_quota", "orphan_grace"};
  return *keys;
}

absl::StatusOr<std::string> Reloader::Reload() {
  auto loaded = LoadConfig(current_.args);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrCat(loaded.status().message(), "; nothing was changed"));
  }
  if (loaded->action != Action::kRun) {
    return absl::InternalError(
        "the saved command line no longer runs the daemon; nothing was changed");
  }
  return Apply(loaded->config);
}

absl::StatusOr<std::string> Reloader::Apply(const Config& next) {
  const Config& cur = current_;
  std::vector<std::string> fixed;
  for (const Setting& s : Settings()) {
    const bool live = s.reload == ReloadPolicy::kLive &&
                      std::find(LiveKeys().begin(), LiveKeys().end(), s.key) != LiveKeys().end();
    if (live) continue;
    const std::string was = s.Get(cur), now = s.Get(next);
    if (was != now) fixed.push_back(absl::StrCat(s.key, " '", was, "' -> '", now, "'"));
  }
  if (!fixed.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(absl::StrJoin(fixed, ", "),
                     ": cannot change while tsd runs; restart tsd to apply (jobs are released), "
                     "or undo the change; nothing was changed"));
  }
  if (pool_locked_ && next.pool_bytes > cur.pool_bytes) {
    const MemlockProbe probe = ProbeMemlock(next.pool_bytes);
    if (!probe.can_lock) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pool_size '", next.pool_size, "' (", wire::FormatBytes(next.pool_bytes),
          ") could not be locked like the current pool: ", probe.reason, "; nothing was changed"));
    }
  }
  if (absl::Status s = registry_.Reconfigure(next.pool_bytes, next.max_job_quota_bytes,
                                             next.orphan_grace_duration);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("pool_size '", next.pool_size, "': ", s.message(),
                                               "; nothing was changed"));
  }
  // Nothing below can fail.
  if (next.log_level != cur.log_level) SetLogLevel(next.log_level);

  std::vector<std::string> changes;
  if (next.log_level != cur.log_level) {
    changes.push_back(absl::StrCat("log_level ", cur.log_level, " -> ", next.log_level));
  }
  if (next.pool_bytes != cur.pool_bytes) {
    changes.push_back(absl::StrCat("pool_size ", cur.pool_size, " -> ", next.pool_size, " (",
                                   wire::FormatBytes(cur.pool_bytes), " -> ",
                                   wire::FormatBytes(next.pool_bytes), ")"));
  }
  if (next.max_job_quota_bytes != cur.max_job_quota_bytes) {
    changes.push_back(absl::StrCat("max_job_quota ", cur.max_job_quota, " -> ", next.max_job_quota,
                                   " (", wire::FormatBytes(cur.max_job_quota_bytes), " -> ",
                                   wire::FormatBytes(next.max_job_quota_bytes), ", for new jobs)"));
  }
  if (next.orphan_grace_duration != cur.orphan_grace_duration) {
    changes.push_back(absl::StrCat("orphan_grace ", cur.orphan_grace, " -> ", next.orphan_grace));
  }
  current_ = next;
  return changes.empty() ? std::string("nothing changed") : absl::StrJoin(changes, ", ");
}

}  // namespace tsd
