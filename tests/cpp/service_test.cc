// tsd as a node service: the systemd readiness protocol (a datagram socket plays systemd), the
// journald log format, live reload on SIGHUP, the Prometheus endpoint checked against tsctl, and
// `tsctl top`. Every test runs a real daemon process; the ones that need a particular environment
// (NOTIFY_SOCKET, JOURNAL_STREAM) or config file start it with the small Service launcher below.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon_process.h"
#include "proto/wire.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

extern char** environ;

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::trunc);
  f << text;
}

// A tsd started with a chosen environment and command line (the socket and `--metrics-listen ""`
// are added; a later --metrics-listen in `args` wins). Its stderr goes to <dir>/tsd.log.
class Service {
 public:
  enum class Journal { kNo, kStderr, kOtherStream };
  struct Options {
    std::vector<std::string> args = {};
    std::vector<std::string> env = {};  // "NAME=value", added to (or replacing) the test's own
    Journal journal = Journal::kNo;
    bool wait_until_up = true;
    bool metrics_off = true;  // pass --metrics-listen "" first
  };

  static std::unique_ptr<Service> Start(Options o) {
    std::unique_ptr<Service> s(new Service);
    char tmpl[] = "/tmp/tsdsvc-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
      return nullptr;
    }
    s->dir_ = tmpl;
    s->socket_ = s->dir_ + "/tsd.sock";
    std::vector<std::string> args = {TSD_BINARY, "--socket", s->socket_};
    if (o.metrics_off) args.insert(args.end(), {"--metrics-listen", ""});
    args.insert(args.end(), o.args.begin(), o.args.end());
    const int log = open(s->log_path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    struct stat st {};
    fstat(log, &st);
    if (o.journal == Journal::kStderr) {
      o.env.push_back("JOURNAL_STREAM=" + std::to_string(st.st_dev) + ":" +
                      std::to_string(st.st_ino));
    } else if (o.journal == Journal::kOtherStream) {
      o.env.push_back("JOURNAL_STREAM=" + std::to_string(st.st_dev) + ":" +
                      std::to_string(st.st_ino + 1));
    }
    // The environment is built here: after fork only async-signal-safe calls are made.
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string var(*e);
      const std::string name = var.substr(0, var.find('='));
      bool replaced =
          name == "NOTIFY_SOCKET" || name == "JOURNAL_STREAM" || name == "RUNTIME_DIRECTORY";
      for (const auto& mine : o.env) replaced |= mine.substr(0, mine.find('=')) == name;
      if (!replaced) env.push_back(var);
    }
    env.insert(env.end(), o.env.begin(), o.env.end());
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(log, 2);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(log);
    s->pid_ = pid;
    if (o.wait_until_up &&
        !WaitFor([&] { return s->exited() || tsd::Client::Connect(s->socket_).ok(); }, 10)) {
      ADD_FAILURE() << "tsd did not come up; its log:\n" << s->log();
      return nullptr;
    }
    if (o.wait_until_up && s->exited()) {
      ADD_FAILURE() << "tsd exited at start; its log:\n" << s->log();
      return nullptr;
    }
    return s;
  }

  ~Service() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (!::testing::Test::HasFailure()) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

  pid_t pid() const { return pid_; }
  const std::string& dir() const { return dir_; }
  const std::string& socket() const { return socket_; }
  std::string log_path() const { return dir_ + "/tsd.log"; }
  std::string log() const { return ReadFile(log_path()); }
  // Polls the log for `text` for up to `seconds`.
  bool WaitForLog(const std::string& text, double seconds = 10) const {
    return WaitFor([&] { return log().find(text) != std::string::npos; }, seconds);
  }
  // True once the process exited (reaped here); `exit_code()` says how.
  bool exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    pid_ = -1;
    return true;
  }
  int exit_code() const { return exit_code_; }
  // Sends `sig` and waits (up to 10 s) for the exit; returns the exit code.
  int Stop(int sig) {
    if (pid_ > 0) kill(pid_, sig);
    EXPECT_TRUE(WaitFor([&] { return exited(); }, 10)) << "tsd did not exit after signal " << sig;
    return exit_code_;
  }

 private:
  Service() = default;
  pid_t pid_ = -1;
  int exit_code_ = -1;
  std::string dir_, socket_;
};

// Plays systemd's part of sd_notify(3): a datagram socket bound at a path, or at an abstract name
// when `path` starts with '@'.
class NotifySocket {
 public:
  explicit NotifySocket(std::string path) : path_(std::move(path)) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path_.data(), path_.size());
    socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path_.size());
    if (path_[0] == '@') {
      addr.sun_path[0] = '\0';
    } else {
      len += 1;
    }
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  }
  ~NotifySocket() {
    close(fd_);
    if (path_[0] == '/') unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  // The next datagram, or nothing within `seconds`.
  std::optional<std::string> Receive(double seconds = 10) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(seconds * 1000)) != 1) return std::nullopt;
    char buf[4096];
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    if (n < 0) return std::nullopt;
    return std::string(buf, static_cast<size_t>(n));
  }
  // Receives until a datagram has the line `line` ("READY=1"); returns that datagram.
  std::optional<std::string> ReceiveUntil(const std::string& line, std::vector<std::string>* before,
                                          double seconds = 10) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      auto m = Receive(
          std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
      if (!m) break;
      if (HasLine(*m, line)) return m;
      if (before) before->push_back(*m);
    }
    return std::nullopt;
  }
  static bool HasLine(const std::string& message, const std::string& line) {
    std::istringstream in(message);
    std::string l;
    while (std::getline(in, l)) {
      if (l == line) return true;
    }
    return false;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

// Whether a Unix socket of `type` at `path` accepts a connection now.
bool Accepts(const std::string& path, int type = SOCK_STREAM) {
  const int fd = ::socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// A TCP port that was free a moment ago (bound to port 0, then closed).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// GET http://127.0.0.1:<port><path>; returns the body of a 200 response, or "" (and a failure).
std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ADD_FAILURE() << "connect to 127.0.0.1:" << port << ": " << std::strerror(errno);
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  std::string resp;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  EXPECT_EQ(resp.rfind("HTTP/1.1 200", 0), 0u) << resp.substr(0, 200);
  return body == std::string::npos ? "" : resp.substr(body + 4);
}

// One sample of the Prometheus text format.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// A metric name ([a-zA-Z_:][a-zA-Z0-9_:]*) or, with `colon` false, a label name.
bool IsName(const std::string& s, bool colon = true) {
  if (s.empty() || std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  for (char c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && !(colon && c == ':')) {
      return false;
    }
  }
  return true;
}

// Reads `name="value",...}` from `text` at `*at` (just past the '{') through the '}'; values may
// escape \\, \" and \n. False on any deviation.
bool ParseLabels(const std::string& text, size_t* at, std::map<std::string, std::string>* out) {
  size_t i = *at;
  while (i < text.size() && text[i] != '}') {
    const size_t eq = text.find('=', i);
    if (eq == std::string::npos || !IsName(text.substr(i, eq - i), false)) return false;
    const std::string name = text.substr(i, eq - i);
    if (eq + 1 >= text.size() || text[eq + 1] != '"') return false;
    std::string value;
    size_t j = eq + 2;
    for (; j < text.size() && text[j] != '"'; ++j) {
      if (text[j] == '\\') {
        if (++j >= text.size() || (text[j] != '\\' && text[j] != '"' && text[j] != 'n')) {
          return false;
        }
        value += text[j] == 'n' ? '\n' : text[j];
      } else {
        value += text[j];
      }
    }
    if (j >= text.size() || !out->emplace(name, value).second) return false;
    i = j + 1;
    if (i < text.size() && text[i] == ',') ++i;
  }
  if (i >= text.size()) return false;
  *at = i + 1;
  return true;
}

// Parses the Prometheus text exposition format (version 0.0.4) strictly: every line is a
// comment, a HELP or TYPE line, or a sample; a sample's family has a TYPE line before it; a
// family's TYPE comes once, before its samples; histogram buckets are cumulative and end with
// le="+Inf" equal to _count. Returns the samples, or sets `*error` to the first problem.
std::vector<Sample> ParsePrometheusText(const std::string& text, std::string* error) {
  static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                               "untyped"};
  std::vector<Sample> out;
  std::map<std::string, std::string> types;
  std::set<std::string> seen_samples;
  std::istringstream in(text);
  std::string line;
  int n = 0;
  auto fail = [&](const std::string& why) {
    *error = "line " + std::to_string(n) + ": " + why + ": '" + line + "'";
    return std::vector<Sample>{};
  };
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream words(line.substr(7));
      std::string name, type, extra;
      words >> name >> type;
      if (!IsName(name) || !kTypes.count(type) || (words >> extra)) return fail("bad TYPE line");
      if (types.count(name) || seen_samples.count(name)) {
        return fail("TYPE repeated or after samples");
      }
      types[name] = type;
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) {
      const std::string rest = line.substr(7);
      if (!IsName(rest.substr(0, rest.find(' ')))) return fail("bad HELP line");
      continue;
    }
    if (line[0] == '#') continue;
    Sample s;
    size_t at = line.find_first_of("{ ");
    if (at == std::string::npos) return fail("not a sample");
    s.name = line.substr(0, at);
    if (!IsName(s.name)) return fail("bad metric name");
    if (line[at] == '{') {
      ++at;
      if (!ParseLabels(line, &at, &s.labels)) return fail("bad labels");
    }
    if (at >= line.size() || line[at] != ' ') return fail("no value");
    std::istringstream fields(line.substr(at + 1));
    std::string v, timestamp, extra;
    fields >> v >> timestamp;
    if (v.empty() || (fields >> extra)) return fail("not a sample");
    if (!timestamp.empty() && timestamp.find_first_not_of("-0123456789") != std::string::npos) {
      return fail("bad timestamp");
    }
    std::string lower;
    for (char c : v) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "nan") {
      s.value = std::nan("");
    } else if (lower == "+inf" || lower == "inf") {
      s.value = INFINITY;
    } else if (lower == "-inf") {
      s.value = -INFINITY;
    } else {
      size_t used = 0;
      try {
        s.value = std::stod(v, &used);
      } catch (...) {
        return fail("bad value");
      }
      if (used != v.size()) return fail("bad value");
    }
    std::string family = s.name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string sfx = suffix;
      if (!types.count(family) && family.size() > sfx.size() &&
          family.compare(family.size() - sfx.size(), sfx.size(), sfx) == 0) {
        const std::string base = family.substr(0, family.size() - sfx.size());
        if (types.count(base) && (types[base] == "histogram" || types[base] == "summary"))
          family = base;
      }
    }
    if (!types.count(family)) return fail("sample without a TYPE line for its family");
    seen_samples.insert(family);
    out.push_back(std::move(s));
  }
  // Histograms: cumulative buckets ending at +Inf == _count, per label set.
  std::map<std::string, std::vector<std::pair<double, double>>> buckets;
  std::map<std::string, double> counts;
  auto key = [](const Sample& s, const std::string& family) {
    std::string k = family;
    for (const auto& [name, value] : s.labels) {
      if (name != "le") k += "," + name + "=" + value;
    }
    return k;
  };
  for (const Sample& s : out) {
    for (const auto& [family, type] : types) {
      if (type != "histogram") continue;
      if (s.name == family + "_bucket") {
        if (!s.labels.count("le")) {
          *error = "bucket without le: " + s.name;
          return {};
        }
        const std::string le = s.labels.at("le");
        buckets[key(s, family)].push_back({le == "+Inf" ? INFINITY : std::stod(le), s.value});
      } else if (s.name == family + "_count") {
        counts[key(s, family)] = s.value;
      }
    }
  }
  for (auto& [k, b] : buckets) {
    for (size_t i = 1; i < b.size(); ++i) {
      if (b[i].first <= b[i - 1].first || b[i].second < b[i - 1].second) {
        *error = "histogram buckets not cumulative: " + k;
        return {};
      }
    }
    if (b.empty() || !std::isinf(b.back().first) || b.back().second != counts[k]) {
      *error = "histogram without +Inf bucket equal to _count: " + k;
      return {};
    }
  }
  return out;
}

// The value of the sample `name` with exactly `labels`; NaN when absent.
double Value(const std::vector<Sample>& samples, const std::string& name,
             const std::map<std::string, std::string>& labels = {}) {
  for (const auto& s : samples) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  return std::nan("");
}

// Whether `line` starts like "2026-01-02T03:04:05.678 ", a console log line's timestamp.
bool StartsWithTimestamp(const std::string& line) {
  const std::string mask = "####-##-##T##:##:##.### ";
  if (line.size() < mask.size()) return false;
  for (size_t i = 0; i < mask.size(); ++i) {
    const bool digit = std::isdigit(static_cast<unsigned char>(line[i]));
    if (mask[i] == '#' ? !digit : line[i] != mask[i]) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Readiness: NOTIFY_SOCKET.

TEST(Notify, ReadyOnlyOnceTheSocketAcceptsAndStoppingOnSigterm) {
  char tmpl[] = "/tmp/tsdnotify-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  NotifySocket systemd(std::string(tmpl) + "/notify");
  auto d = Service::Start({.args = {"--pool-size", "64MiB"},
                           .env = {"NOTIFY_SOCKET=" + systemd.path()},
                           .wait_until_up = false});
  ASSERT_TRUE(d);
  std::vector<std::string> before;
  auto ready = systemd.ReceiveUntil("READY=1", &before);
  // At the moment READY=1 arrives the control socket accepts, and calls are answered.
  const bool accepted = Accepts(d->socket());
  ASSERT_TRUE(ready) << "no READY=1 within 10 s; log:\n" << d->log();
  EXPECT_TRUE(accepted) << "READY=1 came before " << d->socket() << " accepted connections";
  EXPECT_TRUE(Accepts(wire::SideSocketPath(d->socket()), SOCK_SEQPACKET));
  auto client = tsd::Client::Connect(d->socket());
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE((*client)->Status().ok());
  EXPECT_THAT(*ready, HasSubstr("STATUS=serving"));
  EXPECT_THAT(*ready, HasSubstr("MAINPID=" + std::to_string(d->pid())));
  for (const auto& m : before) EXPECT_THAT(m, Not(HasSubstr("READY=1")));

  ASSERT_TRUE((*client)->Attach("notify-job").ok());
  kill(d->pid(), SIGTERM);
  auto stopping = systemd.ReceiveUntil("STOPPING=1", nullptr);
  ASSERT_TRUE(stopping) << "no STOPPING=1 after SIGTERM; log:\n" << d->log();
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  std::filesystem::remove_all(tmpl);
}

TEST(Notify, AbstractSocketSeesReloadingThenReady) {
  const std::string name = "@tsd-test-notify-" + std::to_string(getpid());
  NotifySocket systemd(name);
  auto d = Service::Start({.args = {"--pool-size", "64MiB"}, .env = {"NOTIFY_SOCKET=" + name}});
  ASSERT_TRUE(d);
  ASSERT_TRUE(systemd.ReceiveUntil("READY=1", nullptr)) << d->log();
  kill(d->pid(), SIGHUP);
  auto reloading = systemd.ReceiveUntil("RELOADING=1", nullptr);
  ASSERT_TRUE(reloading) << d->log();
  EXPECT_THAT(*reloading, HasSubstr("MONOTONIC_USEC="));
  auto ready = systemd.ReceiveUntil("READY=1", nullptr);
  ASSERT_TRUE(ready) << d->log();
  EXPECT_THAT(*ready, HasSubstr("STATUS=serving; reloaded: nothing changed"));
  kill(d->pid(), SIGINT);
  EXPECT_TRUE(systemd.ReceiveUntil("STOPPING=1", nullptr));
  EXPECT_EQ(d->Stop(SIGINT), 0);
}

TEST(Notify, WithoutNotifySocketNothingIsSentAndTheDaemonRuns) {
  auto d = Service::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  EXPECT_THAT(d->log(), Not(HasSubstr("notify_failed")));
  EXPECT_EQ(d->Stop(SIGTERM), 0);
}

// ---------------------------------------------------------------------------------------------
// Logs.

TEST(Logging, JournalLinesCarryAPriorityAndNoTimestamp) {
  auto d = Service::Start({.args = {"--pool-size", "64MiB"}, .journal = Service::Journal::kStderr});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  const std::string log = d->log();
  EXPECT_THAT(log, HasSubstr("<6>info event=ready "));
  EXPECT_THAT(log, HasSubstr("<6>info event=stopped"));
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_FALSE(StartsWithTimestamp(line)) << line;
    EXPECT_EQ(line[0], '<') << line;
  }
}

TEST(Logging, ConsoleLinesCarryATimestampEvenWithAStaleJournalStream) {
  // JOURNAL_STREAM names another stream (a child of a service that redirected stderr).
  auto d =
      Service::Start({.args = {"--pool-size", "64MiB"}, .journal = Service::Journal::kOtherStream});
  ASSERT_TRUE(d);
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  const std::string log = d->log();
  const size_t ready = log.find("info event=ready ");
  ASSERT_NE(ready, std::string::npos) << log;
  const size_t begin = log.rfind('\n', ready) == std::string::npos ? 0 : log.rfind('\n', ready) + 1;
  EXPECT_TRUE(StartsWithTimestamp(log.substr(begin))) << log;
  EXPECT_EQ(ready - begin, 24u) << log;  // "2026-01-02T03:04:05.678 " then the level
  EXPECT_THAT(d->log(), Not(HasSubstr("<6>")));
}

// ---------------------------------------------------------------------------------------------
// SIGHUP.

std::string ConfigText(const std::string& pool, const std::string& level,
                       const std::string& extra = "") {
  return "pool_size = \"" + pool + "\"\nlog_level = \"" + level + "\"\n" + extra;
}

TEST(Reload, LogLevelAndALargerPoolTakeEffectWithoutDroppingJobs) {
  char tmpl[] = "/tmp/tsdreload-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string conf = std::string(tmpl) + "/tsd.toml";
  WriteFile(conf, ConfigText("64MiB", "info"));
  auto d = Service::Start({.args = {"--config", conf}});
  ASSERT_TRUE(d);
  auto c = tsd::Client::Connect(d->socket());
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE((*c)->Attach("reload-job").ok());
  auto region = (*c)->Alloc("kept", 8 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memset((*region)->data(), 0x5a, (*region)->size());
  EXPECT_THAT(d->log(), Not(HasSubstr(" debug ")));  // info: the alloc was not logged

  WriteFile(conf,
            ConfigText("128MiB", "debug", "max_job_quota = \"50%\"\norphan_grace = \"3s\"\n"));
  kill(d->pid(), SIGHUP);
  ASSERT_TRUE(d->WaitForLog("event=reloaded")) << d->log();
  EXPECT_THAT(d->log(), HasSubstr("log_level info -> debug"));
  EXPECT_THAT(d->log(), HasSubstr("pool_size 64MiB -> 128MiB (64 MiB -> 128 MiB)"));
  auto st = (*c)->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->pool_bytes, 128u << 20);
  EXPECT_EQ(st->max_job_quota_bytes, 64u << 20);
  EXPECT_EQ(st->used_bytes, 8u << 20);
  EXPECT_EQ(st->sessions, 1u);
  // The job and its memory survived; the larger pool is usable; debug lines now appear.
  const auto* bytes = static_cast<const uint8_t*>((*region)->data());
  EXPECT_EQ(bytes[0], 0x5a);
  EXPECT_EQ(bytes[(*region)->size() - 1], 0x5a);
  auto other = tsd::Client::Connect(d->socket());
  ASSERT_TRUE((*other)->Attach("reload-job").ok());
  auto again = (*other)->Map("kept");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(static_cast<const uint8_t*>((*again)->data())[4096], 0x5a);
  // New jobs get the new maximum quota, and the larger pool holds more than the old one could.
  auto fresh = tsd::Client::Connect(d->socket());
  ASSERT_TRUE((*fresh)->Attach("new-job").ok());
  EXPECT_EQ((*fresh)->quota_bytes(), 64u << 20);
  auto big = (*fresh)->Alloc("big", 60 << 20);  // 68 MiB in all: more than the old pool
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_TRUE(d->WaitForLog(" debug ", 5)) << d->log();
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  std::filesystem::remove_all(tmpl);
}

TEST(Reload, APoolSmallerThanWhatIsHeldIsRefusedAndNothingChanges) {
  char tmpl[] = "/tmp/tsdreload-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string conf = std::string(tmpl) + "/tsd.toml";
  WriteFile(conf, ConfigText("64MiB", "info"));
  auto d = Service::Start({.args = {"--config", conf}});
  ASSERT_TRUE(d);
  auto c = tsd::Client::Connect(d->socket());
  ASSERT_TRUE((*c)->Attach("holder").ok());
  ASSERT_TRUE((*c)->Alloc("a", 48 << 20).ok());
  const auto before = *(*c)->Status();

  WriteFile(conf, ConfigText("32MiB", "debug"));  // the level alone would be fine: all or nothing
  kill(d->pid(), SIGHUP);
  ASSERT_TRUE(d->WaitForLog("event=reload_refused")) << d->log();
  const std::string log = d->log();
  EXPECT_THAT(log, HasSubstr("error event=reload_refused"));
  EXPECT_THAT(log, HasSubstr("the new pool of 32 MiB is smaller than the 48 MiB jobs hold now"));
  EXPECT_THAT(log, HasSubstr("job 'holder'"));
  EXPECT_THAT(log, HasSubstr("nothing was changed"));
  const auto after = *(*c)->Status();
  EXPECT_EQ(after.pool_bytes, before.pool_bytes);
  EXPECT_EQ(after.max_job_quota_bytes, before.max_job_quota_bytes);
  EXPECT_EQ(after.used_bytes, 48u << 20);
  ASSERT_TRUE((*c)->Alloc("b", 1 << 20).ok());
  EXPECT_THAT(d->log(), Not(HasSubstr(" debug ")));  // the level did not change either

  // Shrinking down to what is held is allowed.
  WriteFile(conf, ConfigText("49MiB", "info"));
  kill(d->pid(), SIGHUP);
  ASSERT_TRUE(d->WaitForLog("event=reloaded")) << d->log();
  EXPECT_EQ((*c)->Status()->pool_bytes, 49u << 20);
  auto over = (*c)->Alloc("c", 1 << 20);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  std::filesystem::remove_all(tmpl);
}

TEST(Reload, SettingsThatNeedARestartOrABadFileAreRefused) {
  char tmpl[] = "/tmp/tsdreload-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string conf = std::string(tmpl) + "/tsd.toml";
  WriteFile(conf, ConfigText("64MiB", "info"));
  auto d = Service::Start({.args = {"--config", conf}});
  ASSERT_TRUE(d);

  // (socket and metrics_listen are flags here, which win over the file; socket_group is not.)
  WriteFile(conf, ConfigText("128MiB", "info", "socket_group = \"root\"\n"));
  kill(d->pid(), SIGHUP);
  ASSERT_TRUE(d->WaitForLog("event=reload_refused")) << d->log();
  EXPECT_THAT(d->log(), HasSubstr("socket_group '' -> 'root': cannot change while tsd runs"));
  EXPECT_EQ(tsd::Client::Connect(d->socket()).value()->Status()->pool_bytes, 64u << 20);

  WriteFile(conf, "pool_size = \"128MiB\n");  // unterminated string
  kill(d->pid(), SIGHUP);
  ASSERT_TRUE(WaitFor(
      [&] {
        const std::string log = d->log();
        size_t n = 0;
        for (size_t at = log.find("event=reload_refused"); at != std::string::npos;
             at = log.find("event=reload_refused", at + 1)) {
          ++n;
        }
        return n == 2;
      },
      10))
      << d->log();
  EXPECT_THAT(d->log(), HasSubstr("config file " + conf));
  auto c = tsd::Client::Connect(d->socket());
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->Status()->pool_bytes, 64u << 20);
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  std::filesystem::remove_all(tmpl);
}

// ---------------------------------------------------------------------------------------------
// Metrics.

TEST(Metrics, ScrapeParsesAndMatchesTsctl) {
  const int port = FreePort();
  auto d =
      DaemonProcess::Start({.args = {"--pool-size", "256MiB", "--metrics-per-job",
                                     "--metrics-listen", "127.0.0.1:" + std::to_string(port)}});
  ASSERT_TRUE(d);
  auto a = d->Connect(), b = d->Connect(), b2 = d->Connect();
  ASSERT_TRUE(a->Attach("metrics-a", 64 << 20).ok());
  ASSERT_TRUE(b->Attach("metrics-b", 32 << 20).ok());
  ASSERT_TRUE(b2->Attach("metrics-b").ok());
  ASSERT_TRUE(a->Alloc("x", 10 << 20).ok());
  ASSERT_TRUE(a->Alloc("y", 1).ok());
  ASSERT_TRUE(b->Alloc("z", 3 << 20).ok());

  std::string error;
  const std::string text = HttpGet(port, "/metrics");
  const std::vector<Sample> m = ParsePrometheusText(text, &error);
  ASSERT_TRUE(error.empty()) << error << "\n" << text;
  ASSERT_FALSE(m.empty()) << text;

  const std::string tsctl = std::string(TSCTL_BINARY) + " --socket " + d->socket();
  int rc = 0;
  const auto status = nlohmann::json::parse(RunCommand(tsctl + " status --json", &rc));
  ASSERT_EQ(rc, 0);
  const auto jobs = nlohmann::json::parse(RunCommand(tsctl + " jobs --json", &rc));
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(Value(m, "tsd_pool_bytes"), status["pool_bytes"].get<double>());
  EXPECT_EQ(Value(m, "tsd_pool_used_bytes"), status["used_bytes"].get<double>());
  EXPECT_EQ(Value(m, "tsd_jobs"), status["jobs"].get<double>());
  EXPECT_EQ(Value(m, "tsd_sessions"), status["sessions"].get<double>());
  EXPECT_EQ(Value(m, "tsd_pool_used_bytes"), (13 << 20) + 4096);
  EXPECT_EQ(Value(m, "tsd_sessions"), 3);
  EXPECT_EQ(Value(m, "tsd_pool_locked_bytes"),
            status["locked"].get<bool>() ? status["used_bytes"].get<double>() : 0.0);
  EXPECT_EQ(Value(m, "tsd_build_info", {{"version", status["version"].get<std::string>()}}), 1);
  ASSERT_EQ(jobs.size(), 2u);
  for (const auto& j : jobs) {
    const std::map<std::string, std::string> job = {{"job_name", j["name"].get<std::string>()}};
    EXPECT_EQ(Value(m, "tsd_job_used_bytes", job), j["used_bytes"].get<double>()) << j;
    EXPECT_EQ(Value(m, "tsd_job_quota_bytes", job), j["quota_bytes"].get<double>()) << j;
    EXPECT_EQ(Value(m, "tsd_job_sessions", job), j["sessions"].get<double>()) << j;
    EXPECT_EQ(Value(m, "tsd_job_info",
                    {{"job_name", j["name"].get<std::string>()},
                     {"uid", std::to_string(j["uid"].get<unsigned>())}}),
              1);
  }
  EXPECT_EQ(Value(m, "tsd_job_regions", {{"job_name", "metrics-a"}}), 2);

  // A job that ends leaves the endpoint; the figures follow the pool.
  ASSERT_TRUE(a->Detach().ok());
  const std::vector<Sample> later = ParsePrometheusText(HttpGet(port, "/metrics"), &error);
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(Value(later, "tsd_jobs"), 1);
  EXPECT_EQ(Value(later, "tsd_pool_used_bytes"), 3 << 20);
  EXPECT_TRUE(std::isnan(Value(later, "tsd_job_used_bytes", {{"job_name", "metrics-a"}})));
  EXPECT_THAT(d->log(), HasSubstr("metrics=127.0.0.1:" + std::to_string(port)));
}

TEST(Metrics, OptimizerStepsLatencyAndThroughputAreExported) {
  const int port = FreePort();
  auto d =
      DaemonProcess::Start({.args = {"--pool-size", "256MiB", "--metrics-per-job",
                                     "--metrics-listen", "127.0.0.1:" + std::to_string(port)}});
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("metrics-opt").ok());
  tsd::OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 1000, tsd::DType::kF32, tsd::DType::kF32},
                  {0, 300000, tsd::DType::kBF16, tsd::DType::kBF16}};
  auto opt = c->RegisterOptimizer(spec);
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (int step = 0; step < 3; ++step) {
    for (size_t b = 0; b < 2; ++b) ASSERT_TRUE((*opt)->Ready(b).ok());
    ASSERT_TRUE((*opt)->WaitAll().ok());
  }
  std::string error;
  const std::vector<Sample> m = ParsePrometheusText(HttpGet(port, "/metrics"), &error);
  ASSERT_TRUE(error.empty()) << error;
  const std::map<std::string, std::string> job = {{"job_name", "metrics-opt"}};
  EXPECT_EQ(Value(m, "tsd_optimizer_steps_total", job), 3);
  EXPECT_EQ(Value(m, "tsd_optimizer_params_total", job), 3 * 301000);
  EXPECT_EQ(Value(m, "tsd_bucket_update_seconds_count", job), 6);
  EXPECT_GT(Value(m, "tsd_bucket_update_seconds_sum", job), 0);
  EXPECT_EQ(
      Value(m, "tsd_job_optimizer_info", {{"job_name", "metrics-opt"}, {"moment_dtype", "F32"}}),
      1);
  // Until the client reports a step, there is no wait or paging series of the job.
  EXPECT_TRUE(std::isnan(Value(m, "tsd_job_step_wait_seconds", job)));
  ASSERT_TRUE((*opt)->ReportStep(absl::Milliseconds(25), 4096, 1024).ok());
  const std::vector<Sample> r = ParsePrometheusText(HttpGet(port, "/metrics"), &error);
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_DOUBLE_EQ(Value(r, "tsd_job_step_wait_seconds", job), 0.025);
  EXPECT_EQ(Value(r, "tsd_job_paging_bytes_per_step",
                  {{"job_name", "metrics-opt"}, {"direction", "h2d"}}),
            4096);
  EXPECT_EQ(Value(r, "tsd_job_paging_bytes_per_step",
                  {{"job_name", "metrics-opt"}, {"direction", "d2h"}}),
            1024);
}

// Issue 13, defect 9: by default /metrics (which any local user may scrape) shows aggregates
// only, no job's name, owner or usage; `metrics_per_job` turns the per-job series on.
TEST(Metrics, ByDefaultNoJobIsNamed) {
  const int port = FreePort();
  auto d = DaemonProcess::Start(
      {.args = {"--pool-size", "256MiB", "--metrics-listen", "127.0.0.1:" + std::to_string(port)}});
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("secret-project").ok());
  ASSERT_TRUE(c->Alloc("x", 1 << 20).ok());
  tsd::OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 1000, tsd::DType::kF32, tsd::DType::kF32}};
  auto opt = c->RegisterOptimizer(spec);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_TRUE((*opt)->Ready(0).ok());
  ASSERT_TRUE((*opt)->WaitAll().ok());
  const std::string text = HttpGet(port, "/metrics");
  EXPECT_THAT(text, Not(HasSubstr("secret-project")));
  EXPECT_THAT(text, Not(HasSubstr("job_name")));
  EXPECT_THAT(text, Not(HasSubstr("uid=")));
  std::string error;
  const std::vector<Sample> m = ParsePrometheusText(text, &error);
  ASSERT_TRUE(error.empty()) << error;
  EXPECT_EQ(Value(m, "tsd_jobs"), 1);
  EXPECT_GE(Value(m, "tsd_regions"), 1);
  EXPECT_EQ(Value(m, "tsd_optimizer_steps_total"), 1);  // one aggregate series
  EXPECT_EQ(Value(m, "tsd_step_wait_seconds_max"), 0);  // the client reported nothing
  EXPECT_EQ(Value(m, "tsd_paging_bytes_per_step", {{"direction", "h2d"}}), 0);
  EXPECT_TRUE(std::isnan(Value(m, "tsd_job_used_bytes", {{"job_name", "secret-project"}})));
}

TEST(Metrics, ATakenPortFailsTheStartWithAHint) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  auto d = Service::Start(
      {.args = {"--pool-size", "64MiB", "--metrics-listen", taken}, .wait_until_up = false});
  ASSERT_TRUE(d);
  ASSERT_TRUE(WaitFor([&] { return d->exited(); }, 10));
  EXPECT_EQ(d->exit_code(), 1);
  EXPECT_THAT(d->log(), HasSubstr("cannot serve metrics at " + taken));
  EXPECT_THAT(d->log(), HasSubstr("metrics_listen"));
  close(fd);
}

TEST(Metrics, WhenTheDefaultAddressIsTakenTheDaemonRunsWithoutMetrics) {
  // Hold 127.0.0.1:9464 (if something else holds it already, it is taken all the same).
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(9464);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) listen(fd, 1);
  char tmpl[] = "/tmp/tsdmetrics-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string conf = std::string(tmpl) + "/tsd.toml";
  WriteFile(conf, "pool_size = \"64MiB\"\n");  // no metrics_listen: the default
  auto d = Service::Start({.args = {"--config", conf}, .metrics_off = false});
  ASSERT_TRUE(d);
  EXPECT_THAT(d->log(), HasSubstr("warning event=metrics_off"));
  EXPECT_THAT(d->log(), HasSubstr("metrics=off (the default address is taken)"));
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  // Named in the file, the same address is a misconfiguration: the start fails.
  WriteFile(conf, "pool_size = \"64MiB\"\nmetrics_listen = \"127.0.0.1:9464\"\n");
  auto named =
      Service::Start({.args = {"--config", conf}, .wait_until_up = false, .metrics_off = false});
  ASSERT_TRUE(named);
  ASSERT_TRUE(WaitFor([&] { return named->exited(); }, 10)) << named->log();
  EXPECT_EQ(named->exit_code(), 1);
  EXPECT_THAT(named->log(), HasSubstr("cannot serve metrics at 127.0.0.1:9464"));
  close(fd);
  std::filesystem::remove_all(tmpl);
}

TEST(Metrics, AnEmptyAddressServesNothing) {
  auto d = DaemonProcess::Start();  // the harness passes --metrics-listen ""
  ASSERT_TRUE(d);
  EXPECT_THAT(d->log(), HasSubstr("metrics=off"));
}

// ---------------------------------------------------------------------------------------------
// tsctl top.

TEST(Top, BatchFramesListEveryJob) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = d->Connect(), b = d->Connect();
  ASSERT_TRUE(a->Attach("top-small", 32 << 20).ok());
  ASSERT_TRUE(b->Attach("top-large").ok());
  ASSERT_TRUE(a->Alloc("x", 4 << 20).ok());
  ASSERT_TRUE(b->Alloc("y", 16 << 20).ok());
  int rc = 0;
  const std::string out = RunCommand(
      std::string(TSCTL_BINARY) + " --socket " + d->socket() + " top -n 2 -d 0.1 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
  // stdout is a pipe: plain frames, no escape sequences.
  EXPECT_THAT(out, Not(HasSubstr("\x1b[")));
  size_t frames = 0;  // each frame has one memory table (and one activity table)
  for (size_t at = out.find("%QUOTA"); at != std::string::npos; at = out.find("%QUOTA", at + 1))
    ++frames;
  EXPECT_EQ(frames, 2u) << out;
  EXPECT_THAT(out, HasSubstr("pool: 20 MiB used of 256 MiB"));
  EXPECT_THAT(out, HasSubstr("jobs: 2, sessions: 2"));
  // Sorted by use: the large job first.
  EXPECT_LT(out.find("top-large"), out.find("top-small")) << out;
  // JOB UID SESS REGIONS USED QUOTA %QUOTA %POOL RATE
  std::istringstream row(out.substr(out.find("top-small")));
  std::string job, uid, sess, regions, used, used_unit, quota, quota_unit, pct;
  row >> job >> uid >> sess >> regions >> used >> used_unit >> quota >> quota_unit >> pct;
  EXPECT_EQ(sess + " " + regions + " " + used + used_unit + " " + quota + quota_unit + " " + pct,
            "1 1 4MiB 32MiB 12.5")
      << out;
  const std::string by_name =
      RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() + " top -n 1 --sort name");
  EXPECT_LT(by_name.find("top-large"), by_name.find("top-small"));
}

TEST(Top, OnATerminalItRedrawsInPlace) {
  if (RunCommand("command -v script").empty()) GTEST_SKIP() << "script(1) is not installed";
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = d->Connect();
  ASSERT_TRUE(a->Attach("top-tty").ok());
  int rc = 0;
  // script(1) gives tsctl a pseudo-terminal.
  const std::string out = RunCommand("script -qec '" + std::string(TSCTL_BINARY) + " --socket " +
                                         d->socket() + " top -n 3 -d 0.1' /dev/null </dev/null",
                                     &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("\x1b[?1049h"), 0u) << out;                 // alternate screen first
  EXPECT_NE(out.find("\x1b[?1049l"), std::string::npos) << out;  // and restored at the end
  size_t homes = 0;
  for (size_t at = out.find("\x1b[H"); at != std::string::npos; at = out.find("\x1b[H", at + 1))
    ++homes;
  EXPECT_EQ(homes, 3u);  // each frame is drawn over the last
  EXPECT_THAT(out, HasSubstr("top-tty"));
}

}  // namespace
}  // namespace tsd::testing
