// tsd: the TrainStream daemon. See daemon/daemon.h for what it runs and `tsd --help` for flags.
#include <iostream>

#include "daemon/ops/config.h"
#include "daemon/daemon.h"
#include "daemon/ops/logging.h"

int main(int argc, char** argv) {
  auto loaded = tsd::LoadConfig(argc, argv);
  if (!loaded.ok()) {
    std::cerr << "tsd: " << loaded.status().message() << "\n";
    return 2;
  }
  switch (loaded->action) {
    case tsd::Action::kExit:
      return loaded->exit_code;
    case tsd::Action::kPrintConfig:
      std::cout << tsd::ConfigToToml(loaded->config);
      return 0;
    case tsd::Action::kRun:
      break;
  }
  tsd::SetupLogging(loaded->config.log_level);
  return tsd::RunDaemon(loaded->config);
}
