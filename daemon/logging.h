// Sets up spdlog: one line per event with key=value fields. Under systemd (JOURNAL_STREAM set)
// lines carry no timestamp of their own, since journald adds one.
#pragma once

#include <string>

namespace tsd {

void SetupLogging(const std::string& level);

}  // namespace tsd
