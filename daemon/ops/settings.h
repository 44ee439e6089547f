// The settings of tsd, declared once. Each entry of Settings() says what a setting is called in
// the TOML file and on the command line, what it means, its type and range, its default, and
// whether a live reload (SIGHUP) may change it. Everything else follows from the table: the TOML
// reader and the flags (daemon/ops/config.cc), `--help`, `--print-config`, Config's defaults, the
// reload rules (daemon/ops/reload.cc), and the test that deploy/tsd.toml and docs/daemon.md
// document every setting (tests/cpp/config_test.cc). Adding a setting is adding an entry here, a
// field to Config, and its documentation.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "daemon/ops/config.h"

namespace tsd {

enum class SettingType {
  kText,      // a free string (a path, a group name)
  kSize,      // "64GiB", "512MiB", "60%", or bytes (a TOML integer is accepted too)
  kDuration,  // "0", "500ms", "30s", "5m"; a plain number is seconds
  kChoice,    // one of `choices`
  kAddress,   // "HOST:PORT", "[IPv6]:PORT", or "" (off)
  kInt,       // an integer in [min, max]
  kBool,      // true or false (on the command line, a flag without a value)
};

enum class ReloadPolicy {
  kLive,     // a reload applies a new value while jobs keep running
  kRestart,  // a reload that changes it is refused as a whole: it needs a restart
};

struct Setting {
  absl::string_view key = {};   // in the TOML file and --print-config: "pool_size"
  absl::string_view flag = {};  // on the command line: "--pool-size"
  absl::string_view help = {};  // one line for --help (the default is appended)
  SettingType type = SettingType::kText;
  // Where it lives in Config: text-like types are strings, kInt an int, kBool a bool.
  std::variant<std::string Config::*, int Config::*, bool Config::*> field = {};
  absl::string_view default_value = {};  // as --print-config writes it ("50%", "10", "false", "")
  ReloadPolicy reload = ReloadPolicy::kRestart;
  int64_t min = 0, max = 0;                     // kInt: the range
  std::vector<absl::string_view> choices = {};  // kChoice: the values allowed
  absl::string_view default_help = {};          // --help's words for a computed default, else empty
  bool last_flag_wins = false;  // the flag may repeat and the last one counts (else it is an error)

  // The value in `config`, as text ("true", "10", "64GiB").
  std::string Get(const Config& config) const;
  // Sets the value from text; an error names the setting and says what is allowed. For a kInt
  // or kBool it checks the type and range; text-like values are checked when the configuration
  // is resolved (LoadConfig), where sizes and shares are known.
  absl::Status Set(Config& config, absl::string_view text) const;
  bool is_string() const { return std::holds_alternative<std::string Config::*>(field); }
  // "an integer in [-20, 19]", "true or false", "one of trace, debug, ...", "a string".
  std::string Expected() const;
};

// Every setting, in the order --help and the documentation list them.
const std::vector<Setting>& Settings();
// The setting called `key`, or null.
const Setting* FindSetting(absl::string_view key);
// The keys, comma-separated (for "unknown setting" errors).
std::string SettingKeys();

}  // namespace tsd
