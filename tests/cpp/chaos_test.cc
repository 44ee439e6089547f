// Chaos: real C++ clients (libtsclient) killed with SIGKILL at random points against one real
// tsd, and a daemon killed and restarted under attached, stepping jobs.
//
// Each client is this binary re-executed in a client mode (fork + exec, so no gRPC state crosses
// a fork): it connects, reaches its phase (attach, alloc, register, step or save), says "go" on
// a pipe and repeats that phase's work without end; the test kills it a random 0 to 5 ms later,
// so the kill lands anywhere in the phase's calls. After all cycles the daemon must be back where
// it started: no bytes used, no job, no session, and its descriptors (/proc/PID/fd), mappings
// (/proc/PID/maps) and threads (/proc/PID/task) within a small bound of the baseline taken after a
// warm-up (gRPC and malloc keep a few of their own; a leak per cycle would exceed the bound by
// hundreds).
//
// Cycles: 200 by default (ctest sets TSD_CHAOS_CYCLES: 200, 100 under a sanitizer); more with
// `--chaos_cycles=N` or TSD_CHAOS_CYCLES=N, e.g.
//   build/bin/tsd_chaos_tests --chaos_cycles=1000
// The random seed is printed; TSD_CHAOS_SEED=S repeats a run's choice of phases and delays.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "proto/status_macros.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

int g_cycles = 200;
std::string g_self;  // this binary, for the client processes

int64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// --- The client side (runs in a child process) ------------------------------------------------

void Say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

OptimizerSpec SmallSpec(bool clip) {
  OptimizerSpec spec;
  spec.groups = {{}, {.lr = 1e-2}};
  spec.buckets = {{0, 4096, DType::kF32, DType::kF32},
                  {1, 70000, DType::kBF16, DType::kBF16},
                  {0, 1000, DType::kF32, DType::kF32}};
  spec.max_grad_norm = clip ? 1.0 : 0.0;
  return spec;
}

// One optimizer step: every bucket delivered, then waited for (or committed, with clipping).
absl::Status Step(Optimizer& opt, bool clip) {
  for (size_t b = 0; b < opt.num_buckets(); ++b) {
    std::memset(opt.grad(b), 0x3c, opt.numel(b) * (b == 1 ? 2 : 4));
    TSD_RETURN_IF_ERROR(opt.Ready(b));
  }
  return clip ? opt.Commit(absl::Seconds(30)) : opt.WaitAll(absl::Seconds(30));
}

absl::StatusOr<std::unique_ptr<Client>> Attached(const std::string& socket,
                                                 const std::string& job) {
  TSD_ASSIGN_OR_RETURN(auto client, Client::Connect(socket));
  TSD_RETURN_IF_ERROR(client->Attach(job, 64ull << 20));
  return client;
}

// Runs one client mode; returns the process's exit code. Loops forever in the chaos phases.
int ClientMain(const std::string& socket, const std::string& job, const std::string& mode) {
  std::mt19937_64 rng(getpid());
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "chaos client: %s\n", s.ToString().c_str());
    return 3;
  };
  if (mode == "attach") {
    Say("go");
    for (;;) {
      auto c = Attached(socket, job);
      if (!c.ok()) return fail(c.status());
      if (auto s = (*c)->Detach(); !s.ok()) return fail(s);
    }
  }
  if (mode == "register") {
    Say("go");
    for (uint64_t i = 0;; ++i) {
      auto c = Attached(socket, job);
      if (!c.ok()) return fail(c.status());
      auto opt = (*c)->RegisterOptimizer(SmallSpec(i % 2));
      if (!opt.ok()) return fail(opt.status());
      opt->reset();
      if (auto s = (*c)->Detach(); !s.ok()) return fail(s);
    }
  }
  auto c = Attached(socket, job);
  if (!c.ok()) return fail(c.status());
  if (mode == "alloc") {
    std::vector<std::shared_ptr<Region>> held;
    Say("go");
    for (uint64_t i = 0;; ++i) {
      if (held.size() < 8) {
        auto r = (*c)->Alloc("r" + std::to_string(i), 4096 + rng() % (1 << 20));
        if (!r.ok()) return fail(r.status());
        std::memset((*r)->data(), 0x5a, (*r)->size());
        held.push_back(*r);
      } else {
        const size_t k = rng() % held.size();
        if (auto s = (*c)->Free(held[k]); !s.ok()) return fail(s);
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
  }
  const bool clip = rng() % 2;
  auto opt = (*c)->RegisterOptimizer(SmallSpec(clip));
  if (!opt.ok()) return fail(opt.status());
  for (size_t b = 0; b < (*opt)->num_buckets(); ++b) {
    std::fill_n((*opt)->master(b), (*opt)->numel(b), 0.5f);
  }
  if (mode == "step") {
    Say("go");
    for (;;) {
      if (auto s = Step(**opt, clip); !s.ok()) return fail(s);
    }
  }
  if (mode == "save") {
    if (auto s = Step(**opt, clip); !s.ok()) return fail(s);
    const int fd = memfd_create("chaos-state", MFD_CLOEXEC);
    Say("go");
    for (;;) {
      if (ftruncate(fd, 0) != 0 || lseek(fd, 0, SEEK_SET) != 0) return 4;
      if (auto s = (*opt)->SaveState(fd); !s.ok()) return fail(s.status());
      if (rng() % 2) {
        lseek(fd, 0, SEEK_SET);
        if (auto s = (*opt)->LoadState(fd); !s.ok()) return fail(s.status());
      }
    }
  }
  if (mode == "survive") {
    // Steps until the daemon goes away, then reports when it noticed and what it was told.
    if (auto s = Step(**opt, clip); !s.ok()) return fail(s);
    Say("go");
    for (;;) {
      if (auto s = Step(**opt, clip); !s.ok()) {
        Say("error_ns=" + std::to_string(MonotonicNs()) + " " + std::string(s.message()));
        return 0;
      }
    }
  }
  if (mode == "steps") {
    for (int i = 0; i < 20; ++i) {
      if (auto s = Step(**opt, clip); !s.ok()) return fail(s);
    }
    Say(std::to_string((*opt)->steps(0)) + " steps");
    return (*opt)->steps(0) == 20 ? 0 : 5;
  }
  std::fprintf(stderr, "chaos client: unknown mode '%s'\n", mode.c_str());
  return 2;
}

// --- The test side ----------------------------------------------------------------------------

// A client process with a pipe from its stdout.
struct Child {
  pid_t pid = -1;
  int out = -1;
  std::string buffered;

  // Reads one line (waiting until `deadline_ns`); false at EOF or on timeout.
  bool ReadLine(std::string* line, int64_t deadline_ns) {
    for (;;) {
      if (const size_t nl = buffered.find('\n'); nl != std::string::npos) {
        *line = buffered.substr(0, nl);
        buffered.erase(0, nl + 1);
        return true;
      }
      const int64_t left_ms = (deadline_ns - MonotonicNs()) / 1'000'000;
      if (left_ms <= 0) return false;
      pollfd p{out, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left_ms)) != 1) return false;
      char buf[512];
      const ssize_t n = read(out, buf, sizeof(buf));
      if (n <= 0) return false;
      buffered.append(buf, static_cast<size_t>(n));
    }
  }
  // SIGKILLs (when `kill_it`) and reaps; returns the wait status.
  int Reap(bool kill_it) {
    if (kill_it) kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    close(out);
    pid = -1;
    return status;
  }
};

Child Spawn(const std::string& socket, const std::string& job, const std::string& mode) {
  Child c;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return c;
  c.pid = fork();
  if (c.pid == 0) {
    dup2(p[1], 1);
    execl(g_self.c_str(), g_self.c_str(), "--chaos-client", socket.c_str(), job.c_str(),
          mode.c_str(), nullptr);
    _exit(127);
  }
  close(p[1]);
  c.out = p[0];
  return c;
}

int CountEntries(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

int CountLines(const std::string& path) {
  std::ifstream f(path);
  int n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

// What the chaos test compares before and after.
struct Footprint {
  int fds = 0, maps = 0, threads = 0;
};

Footprint FootprintOf(pid_t pid) {
  const std::string proc = "/proc/" + std::to_string(pid);
  return {CountEntries(proc + "/fd"), CountLines(proc + "/maps"), CountEntries(proc + "/task")};
}

// True once the daemon holds no bytes, no job and no session (the observer uses no session).
bool Idle(Client& observer, PoolStatus* last) {
  auto st = observer.Status();
  if (!st.ok()) return false;
  *last = *st;
  return st->used_bytes == 0 && st->jobs == 0 && st->sessions == 0;
}

const char* const kPhases[] = {"attach", "alloc", "register", "step", "save"};

TEST(Chaos, ClientsKilledAtRandomPointsLeakNothing) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  ASSERT_TRUE(observer);
  const char* seed_env = std::getenv("TSD_CHAOS_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : MonotonicNs();
  std::printf("chaos: %d cycles, seed %llu (TSD_CHAOS_SEED repeats it)\n", g_cycles,
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  std::map<std::string, int> reached, early_exits;
  int64_t cycle_ns = 0;
  // One cycle: a client of a random phase, killed 0 to 5 ms after it got there.
  auto cycle = [&](int i, const char* phase) {
    const int64_t t0 = MonotonicNs();
    Child c = Spawn(d->socket(), "chaos-" + std::to_string(i), phase);
    ASSERT_GT(c.pid, 0);
    std::string line;
    const bool go = c.ReadLine(&line, MonotonicNs() + 20'000'000'000);
    if (go) {
      reached[phase]++;
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 5000));
    }
    const int status = c.Reap(true);
    // A client only ends by our SIGKILL: anything else is a failed call, which is a finding.
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
      early_exits[phase]++;
      ADD_FAILURE() << "cycle " << i << " (" << phase << "): the client ended by itself (status "
                    << status << "); the daemon's log:\n"
                    << d->log().substr(d->log().size() > 4000 ? d->log().size() - 4000 : 0);
    }
    cycle_ns += MonotonicNs() - t0;
  };
  // Warm-up (one of each phase), so that the baseline includes the daemon's lazily started
  // threads and caches.
  for (int i = 0; i < 5; ++i) cycle(-1 - i, kPhases[i]);
  PoolStatus st;
  ASSERT_TRUE(WaitFor([&] { return Idle(*observer, &st); }, 10))
      << "after the warm-up: used " << st.used_bytes << " jobs " << st.jobs;
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const Footprint before = FootprintOf(d->pid());
  cycle_ns = 0;
  for (int i = 0; i < g_cycles && !HasFailure(); ++i) cycle(i, kPhases[rng() % 5]);
  ASSERT_FALSE(HasFailure());
  for (const char* p : kPhases) {
    std::printf("chaos: phase %-8s reached %d times\n", p, reached[p]);
  }
  std::printf("chaos: %.1f ms a cycle\n", cycle_ns / 1e6 / g_cycles);

  // The books balance: every killed client's session, job and bytes are gone.
  EXPECT_TRUE(WaitFor([&] { return Idle(*observer, &st); }, 10))
      << "used " << st.used_bytes << " bytes, " << st.jobs << " jobs, " << st.sessions
      << " sessions left after " << g_cycles << " killed clients";
  // Descriptors, mappings and threads back within a small bound of the baseline (a leak of one
  // a cycle would exceed it by the number of cycles).
  constexpr int kFdSlack = 8, kMapSlack = 64, kThreadSlack = 8;
#if defined(__SANITIZE_THREAD__)
  // Under TSan the daemon's mappings are mostly TSan's own: its allocator and the per-thread state
  // of every thread the daemon ever started (gRPC's connection threads come and go) are mapped as
  // they are first needed and kept. Measured: +221 mappings over 100 cycles with fds and threads
  // flat, where the plain build moves by 1 over 1,000 cycles and ASan stays within the bound. So
  // this build checks descriptors, threads and bytes; the others check mappings too.
  constexpr bool kCheckMaps = false;
#else
  constexpr bool kCheckMaps = true;
#endif
  Footprint after;
  const bool settled = WaitFor(
      [&] {
        after = FootprintOf(d->pid());
        return after.fds <= before.fds + kFdSlack &&
               (!kCheckMaps || after.maps <= before.maps + kMapSlack) &&
               after.threads <= before.threads + kThreadSlack;
      },
      10);
  std::printf("chaos: fds %d -> %d, maps %d -> %d, threads %d -> %d\n", before.fds, after.fds,
              before.maps, after.maps, before.threads, after.threads);
  EXPECT_TRUE(settled) << "the daemon grew: fds " << before.fds << " -> " << after.fds << ", maps "
                       << before.maps << " -> " << after.maps << ", threads " << before.threads
                       << " -> " << after.threads;
  // And it still serves: a new job steps.
  Child c = Spawn(d->socket(), "after-chaos", "steps");
  std::string line;
  EXPECT_TRUE(c.ReadLine(&line, MonotonicNs() + 30'000'000'000));
  EXPECT_EQ(line, "20 steps");
  const int status = c.Reap(false);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// Starts tsd on `socket` (a daemon killed there before) and waits until it answers.
pid_t StartTsdOn(const std::string& socket, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 2);
    execl(TSD_BINARY, TSD_BINARY, "--socket", socket.c_str(), "--metrics-listen", "", "--pool-size",
          "256MiB", nullptr);
    _exit(127);
  }
  const bool up = WaitFor([&] { return Client::Connect(socket).ok(); }, 10);
  if (!up) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    return -1;
  }
  return pid;
}

// The bound on how soon a stepping trainer hears that tsd died. The client checks the daemon's
// connection between futex waits of 50 ms, so the real figure is tens of milliseconds; 1 s
// leaves room for a contended machine and sanitizers. A behaviour bound, not a benchmark.
constexpr double kNoticeBoundS = 1.0;

TEST(Chaos, DaemonKilledUnderEightSteppingJobsEachHearsWithinASecond) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  const std::string socket = d->socket();
  std::vector<Child> children;
  for (int i = 0; i < 8; ++i) {
    children.push_back(Spawn(socket, "trainer-" + std::to_string(i), "survive"));
    ASSERT_GT(children.back().pid, 0);
  }
  for (auto& c : children) {
    std::string line;
    ASSERT_TRUE(c.ReadLine(&line, MonotonicNs() + 30'000'000'000)) << "a trainer did not start";
    ASSERT_EQ(line, "go");
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // all stepping
  const int64_t killed_ns = MonotonicNs();
  EXPECT_EQ(d->Stop(SIGKILL), 128 + SIGKILL);
  double worst = 0;
  for (auto& c : children) {
    std::string line;
    ASSERT_TRUE(c.ReadLine(&line, killed_ns + 10'000'000'000))
        << "a trainer did not notice the daemon's death within 10 s";
    ASSERT_THAT(line, HasSubstr("error_ns="));
    const double after_s = (std::stoll(line.substr(9)) - killed_ns) / 1e9;
    worst = std::max(worst, after_s);
    EXPECT_LT(after_s, kNoticeBoundS) << line;
    // A clear error: it says tsd went away and what to do.
    EXPECT_THAT(line, HasSubstr("tsd at " + socket));
    EXPECT_THAT(line, HasSubstr("restart it"));
    const int status = c.Reap(false);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  std::printf("chaos: the slowest of 8 trainers heard of the kill after %.1f ms\n", worst * 1e3);

  // A daemon restarted on the same socket serves new jobs.
  const pid_t again = StartTsdOn(socket, d->dir() + "/tsd-restarted.log");
  ASSERT_GT(again, 0) << "tsd did not restart on " << socket;
  Child c = Spawn(socket, "after-restart", "steps");
  std::string line;
  EXPECT_TRUE(c.ReadLine(&line, MonotonicNs() + 30'000'000'000));
  EXPECT_EQ(line, "20 steps");
  const int status = c.Reap(false);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  kill(again, SIGTERM);
  int daemon_status = 0;
  waitpid(again, &daemon_status, 0);
  EXPECT_TRUE(WIFEXITED(daemon_status) && WEXITSTATUS(daemon_status) == 0) << daemon_status;
}

}  // namespace
}  // namespace tsd::testing

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--chaos-client") {
    return tsd::testing::ClientMain(argv[2], argv[3], argv[4]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  if (const char* env = std::getenv("TSD_CHAOS_CYCLES")) tsd::testing::g_cycles = std::atoi(env);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--chaos_cycles=", 0) == 0) {
      tsd::testing::g_cycles = std::atoi(a.c_str() + 15);
    } else {
      std::fprintf(stderr,
                   "tsd_chaos_tests: unknown flag '%s' (besides gtest's: --chaos_cycles=N)\n",
                   a.c_str());
      return 2;
    }
  }
  if (tsd::testing::g_cycles <= 0) {
    std::fprintf(stderr, "tsd_chaos_tests: the cycle count must be positive\n");
    return 2;
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return 2;
  tsd::testing::g_self.assign(self, static_cast<size_t>(n));
  return RUN_ALL_TESTS();
}
