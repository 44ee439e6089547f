// Reloader applies the configuration again while the daemon runs (SIGHUP), without dropping a
// job: it parses the saved command line again (so flags keep winning) over the config file read
// anew, and applies the difference all or nothing.
//
// Which settings a reload may change is the settings table's reload policy
// (daemon/ops/settings.cc): applied live are log_level, pool_size (larger, or smaller but not below
// what jobs hold), max_job_quota (for jobs created from now on; existing jobs keep their quota) and
// orphan_grace; every other setting needs a restart (new sockets, the engine's threads are started
// once). A reload that changes one of those, names a pool smaller than what is held, a pool too
// large to lock, or a file that does not parse is refused as a whole: the error says why, and every
// setting keeps its value.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/jobs/registry.h"
#include "daemon/ops/config.h"

namespace tsd {

class Reloader final {
 public:
  // `current` is what the daemon runs with; `pool_locked` says whether its regions are mlock()ed
  // (then a larger pool must still be lockable).
  Reloader(Config current, Registry& registry, bool pool_locked)
      : current_(std::move(current)), registry_(registry), pool_locked_(pool_locked) {}

  // Loads the configuration again and applies it. Returns what changed ("log_level info ->
  // debug, pool_size 64MiB -> 128MiB (...)", or "nothing changed"); an error changed nothing.
  absl::StatusOr<std::string> Reload();
  // Applies `next`, a loaded configuration, all or nothing.
  absl::StatusOr<std::string> Apply(const Config& next);

  const Config& current() const { return current_; }

  // The settings Apply knows how to change live. A setting the table marks live but that is not
  // here is treated as needing a restart (config_test checks the two agree).
  static const std::vector<absl::string_view>& LiveKeys();

 private:
  Config current_;
  Registry& registry_;
  const bool pool_locked_;
};

}  // namespace tsd
