#include "daemon_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "proto/side_message.h"
#include "proto/wire.h"

namespace tsd::testing {

std::string RunCommand(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  if (rc) *rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return out;
}

bool WaitFor(const std::function<bool()>& pred, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

std::unique_ptr<DaemonProcess> DaemonProcess::Start(DaemonOptions options) {
  std::unique_ptr<DaemonProcess> d(new DaemonProcess);
  char tmpl[] = "/tmp/tsdtest-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) {
    ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    return nullptr;
  }
  d->dir_ = tmpl;
  chmod(d->dir_.c_str(), 0755);  // other uids in the isolation test must reach the socket
  d->socket_ = d->dir_ + "/tsd.sock";
  // No metrics endpoint unless a test asks for one (a later --metrics-listen wins): daemons that
  // run at once must not compete for the default port.
  std::vector<std::string> args = {TSD_BINARY, "--socket",         d->socket_, "--log-level",
                                   "debug",    "--metrics-listen", ""};
  args.insert(args.end(), options.args.begin(), options.args.end());
  const std::string log = d->dir_ + "/tsd.log";
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 2);
    if (options.memlock_limit != 0) {
      prctl(PR_CAPBSET_DROP, 14 /* CAP_IPC_LOCK */, 0, 0, 0);
      rlimit rl{options.memlock_limit, options.memlock_limit};
      setrlimit(RLIMIT_MEMLOCK, &rl);
    }
    if (options.nofile_limit != 0) {
      rlimit rl{options.nofile_limit, options.nofile_limit};
      setrlimit(RLIMIT_NOFILE, &rl);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  d->pid_ = pid;
  const bool up = WaitFor(
      [&] {
        int status;
        if (waitpid(pid, &status, WNOHANG) == pid) {
          d->pid_ = -1;
          return true;
        }
        return tsd::Client::Connect(d->socket_).ok();
      },
      10);
  if (!up || d->pid_ < 0) {
    ADD_FAILURE() << "tsd did not come up; its log:\n" << d->log();
    return nullptr;
  }
  return d;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!dir_.empty() && !::testing::Test::HasFailure()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

std::string DaemonProcess::side_socket() const { return wire::SideSocketPath(socket_); }

std::string DaemonProcess::log() const {
  std::ifstream f(dir_ + "/tsd.log");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int DaemonProcess::Stop(int sig, double* seconds) {
  if (pid_ <= 0) return -1;
  const auto t0 = std::chrono::steady_clock::now();
  kill(pid_, sig);
  int status = 0;
  waitpid(pid_, &status, 0);
  if (seconds)
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  pid_ = -1;
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

int DaemonProcess::OpenFds() const {
  int n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid_) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

uint64_t DaemonProcess::PeakRssKib() const {
  std::ifstream status("/proc/" + std::to_string(pid_) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

void ExpectPeakRssGrowthBelow(const DaemonProcess& d, uint64_t before_kib, uint64_t bound_kib,
                              const std::string& what) {
#ifdef TSD_SANITIZED
  (void)d, (void)before_kib, (void)bound_kib, (void)what;
#else
  const uint64_t grew_kib = d.PeakRssKib() - before_kib;
  std::printf("peak RSS grew by %llu MiB for %s\n", static_cast<unsigned long long>(grew_kib >> 10),
              what.c_str());
  EXPECT_LT(grew_kib, bound_kib) << "peak RSS grew by " << (grew_kib >> 10) << " MiB for " << what;
#endif
}

std::unique_ptr<tsd::Client> DaemonProcess::Connect() const {
  auto c = tsd::Client::Connect(socket_);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

RawSession::RawSession(const std::string& socket) : socket_(socket) {}

RawSession::~RawSession() {
  if (side_fd_ >= 0) close(side_fd_);
}

int RawSession::ConnectSide() {
  if (side_fd_ >= 0) close(side_fd_);
  side_fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string side = wire::SideSocketPath(socket_);
  std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
  EXPECT_EQ(connect(side_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
      << std::strerror(errno);
  return side_fd_;
}

bool RawSession::Read(v1::SideReply* out, int timeout_ms, int* fd_out) {
  wire::SideAssembler<v1::SideReply> assembler;
  for (;;) {
    pollfd p{side_fd_, POLLIN, 0};
    if (poll(&p, 1, timeout_ms) != 1) return false;
    auto d = wire::ReceiveDatagram(side_fd_, false);
    if (!d.ok()) return false;
    uint64_t id = 0;
    auto whole = assembler.Feed(std::move(*d), &id);
    EXPECT_TRUE(whole.ok()) << whole.status();
    if (!whole.ok()) return false;
    if (!*whole) continue;
    *out = std::move(assembler.message());
    const int fd = assembler.TakeFd();
    if (fd_out != nullptr) {
      *fd_out = fd;
    } else if (fd >= 0) {
      close(fd);
    }
    return true;
  }
}

namespace {
// The daemon may close right after an error reply: peek for EOF briefly.
bool ClosedSoon(int fd) {
  pollfd q{fd, POLLIN, 0};
  if (poll(&q, 1, 200) != 1) return false;
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}
}  // namespace

v1::SideReply RawSession::Request(v1::SideRequest req, bool* closed, int* fd_out, int send_fd) {
  if (req.request_id() == 0) req.set_request_id(next_id_++);
  EXPECT_TRUE(wire::SendSideMessage(side_fd_, req, send_fd, 5000).ok());
  v1::SideReply reply;
  const bool got = Read(&reply, 5000, fd_out);
  if (closed != nullptr) *closed = !got || ClosedSoon(side_fd_);
  return reply;
}

v1::SideReply RawSession::SendRaw(const std::string& bytes, bool* closed, int* fd_out) {
  v1::SideReply reply;
  if (closed) *closed = false;
  EXPECT_TRUE(wire::SendDatagram(side_fd_, bytes).ok());
  pollfd p{side_fd_, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 5000), 1) << "no reply from tsd within 5 s";
  auto d = wire::ReceiveDatagram(side_fd_, false);
  if (!d.ok()) {
    if (closed) *closed = true;
    return reply;
  }
  EXPECT_TRUE(reply.ParseFromString(d->bytes));
  if (fd_out) {
    *fd_out = d->fd;
  } else if (d->fd >= 0) {
    close(d->fd);
  }
  if (closed) *closed = ClosedSoon(side_fd_);
  return reply;
}

v1::SideReply RawSession::Attach(const std::string& job, uint64_t quota, uint32_t protocol) {
  ConnectSide();
  v1::SideRequest req;
  req.mutable_attach()->set_job(job);
  req.mutable_attach()->set_quota_bytes(quota);
  req.mutable_attach()->set_protocol_version(protocol);
  req.mutable_attach()->set_client_version("raw test session");
  return Request(std::move(req));
}

uint64_t RawSession::Open(const std::string& job, uint64_t quota) {
  v1::SideReply r = Attach(job, quota);
  EXPECT_EQ(r.code(), 0) << r.message();
  return r.attach().session_id();
}

}  // namespace tsd::testing
