#include "daemon/logging.h"

#include <cstdlib>

#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace tsd {

void SetupLogging(const std::string& level) {
  auto logger = spdlog::stderr_logger_mt("tsd");
  if (std::getenv("JOURNAL_STREAM") != nullptr) {
    logger->set_pattern("%l %v");
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace tsd
