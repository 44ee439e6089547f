#include "daemon/ops/logging.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "google/protobuf/stubs/logging.h"
#include "spdlog/pattern_formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

// `%*` in a pattern: the syslog priority of the message's level (sd-daemon.h's SD_ERR etc.),
// which journald reads from a "<N>" prefix.
class SyslogPriorityFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    int priority = 6;  // LOG_INFO
    switch (msg.level) {
      case spdlog::level::trace:
      case spdlog::level::debug:
        priority = 7;  // LOG_DEBUG
        break;
      case spdlog::level::info:
        priority = 6;  // LOG_INFO
        break;
      case spdlog::level::warn:
        priority = 4;  // LOG_WARNING
        break;
      case spdlog::level::err:
        priority = 3;  // LOG_ERR
        break;
      case spdlog::level::critical:
        priority = 2;  // LOG_CRIT
        break;
      default:
        break;
    }
    dest.push_back('0' + static_cast<char>(priority));
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<SyslogPriorityFlag>();
  }
};

// Where libprotobuf's own log lines go. Its warnings and errors come from parsing what a client
// sent (a string field that is not UTF-8, say); tsd already refuses that request with a message
// saying what was wrong, and logs its own event where it keeps one, so these lines are debug
// detail. Left on stderr they would be unformatted lines, one per hostile request, in tsd's log.
// A fatal one is kept at critical: protobuf ends the process right after.
void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                 const std::string& message) {
  const spdlog::level::level_enum to =
      level == google::protobuf::LOGLEVEL_FATAL ? spdlog::level::critical : spdlog::level::debug;
  spdlog::log(to, "event=protobuf_log file={}:{} message=\"{}\"", file, line, message);
}

}  // namespace

bool StderrIsJournal() {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (stream == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  if (std::sscanf(stream, "%llu:%llu", &dev, &ino) != 2) return false;
  struct stat st {};
  if (fstat(STDERR_FILENO, &st) != 0) return false;
  return static_cast<unsigned long long>(st.st_dev) == dev &&
         static_cast<unsigned long long>(st.st_ino) == ino;
}

void SetupLogging(const std::string& level) {
  auto logger = spdlog::stderr_color_mt("tsd");  // colours only when stderr is a terminal
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (StderrIsJournal()) {
    formatter->add_flag<SyslogPriorityFlag>('*').set_pattern("<%*>%l %v");
  } else {
    formatter->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %v");
  }
  logger->set_formatter(std::move(formatter));
  logger->set_level(spdlog::level::from_str(level));
  logger->flush_on(spdlog::level::trace);  // stderr is unbuffered: flushing costs nothing
  spdlog::set_default_logger(logger);
  google::protobuf::SetLogHandler(&ProtobufLog);
}

void SetLogLevel(const std::string& level) {
  spdlog::default_logger()->set_level(spdlog::level::from_str(level));
}

}  // namespace tsd
