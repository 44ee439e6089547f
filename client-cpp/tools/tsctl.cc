// tsctl: inspect a running tsd. `tsctl status` shows the pool, `tsctl jobs` the jobs on it;
// `--json` prints machine-readable output with stable keys. `tsctl top` is a live per-job view
// that redraws in place, like top(1). `tsctl checkpoint JOB FILE` has tsd write a job's optimizer
// state into FILE (tsctl_checkpoint.cc).
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "client-cpp/tools/activity_view.h"
#include "proto/wire.h"
#include "tsctl_checkpoint.h"
#include "tsd/client.h"

namespace {

int PrintStatus(tsd::Client& client, bool json) {
  auto s = client.Status();
  if (!s.ok()) {
    std::cerr << "tsctl: " << s.status().message() << "\n";
    return 1;
  }
  if (json) {
    nlohmann::json j = {{"version", s->version},       {"uptime", s->uptime_s},
                        {"pool_bytes", s->pool_bytes}, {"used_bytes", s->used_bytes},
                        {"locked", s->locked},         {"jobs", s->jobs},
                        {"sessions", s->sessions}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("tsd %s (pid %u, protocol %u) at %s, up %.0f s\n", s->version.c_str(), s->pid,
              s->protocol_version, client.socket_path().c_str(), s->uptime_s);
  if (s->protocol_version != tsd::wire::kProtocolVersion) {
    std::printf(
        "note      this tsctl speaks protocol %u: sessions of clients built with it will be "
        "refused; upgrade the %s\n",
        tsd::wire::kProtocolVersion,
        s->protocol_version > tsd::wire::kProtocolVersion ? "clients" : "daemon");
  }
  std::printf("pool      %s used of %s (%s)\n", tsd::wire::FormatBytes(s->used_bytes).c_str(),
              tsd::wire::FormatBytes(s->pool_bytes).c_str(), s->locked ? "locked" : "NOT locked");
  std::printf("jobs      %u\nsessions  %u\n", s->jobs, s->sessions);
  return 0;
}

int PrintJobs(tsd::Client& client, bool json) {
  auto jobs = client.Jobs();
  if (!jobs.ok()) {
    std::cerr << "tsctl: " << jobs.status().message() << "\n";
    return 1;
  }
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& j : *jobs) {
      out.push_back(
          {{"name", j.name},
           {"uid", j.uid},
           {"sessions", j.sessions},
           {"used_bytes", j.used_bytes},
           {"quota_bytes", j.quota_bytes},
           {"numa_node", j.numa_node >= 0 ? nlohmann::json(j.numa_node) : nlohmann::json()},
           {"activity", tsd::tsctl::ActivityJson(j)}});
    }
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::printf("%-32s %8s %8s %12s %12s\n", "JOB", "UID", "SESSIONS", "USED", "QUOTA");
  for (const auto& j : *jobs) {
    std::printf("%-32s %8u %8u %12s %12s\n", j.name.c_str(), j.uid, j.sessions,
                tsd::wire::FormatBytes(j.used_bytes).c_str(),
                tsd::wire::FormatBytes(j.quota_bytes).c_str());
  }
  return 0;
}

// What `tsctl stores` says of the stores it does not show: those of other uids (a store is
// listed only to the uids that proved they may read its files), and any left out of the reply.
std::string NotShownNote(const tsd::StoreListing& listing) {
  std::string note;
  const uint64_t others =
      listing.not_shown() > listing.omitted ? listing.not_shown() - listing.omitted : 0;
  if (others > 0) {
    note += std::to_string(others) + (others == 1 ? " more store" : " more stores") +
            " held by other users " + (others == 1 ? "is" : "are") +
            " not shown (tsd lists a store to the users whose jobs opened it with its files; "
            "totals: " +
            std::to_string(listing.node_stores) +
            (listing.node_stores == 1 ? " store, " : " stores, ") +
            tsd::wire::FormatBytes(listing.node_bytes) + " of the " +
            tsd::wire::FormatBytes(listing.budget_bytes) + " store budget)\n";
  }
  if (listing.omitted > 0) {
    note += std::to_string(listing.omitted) +
            " of your stores did not fit tsd's reply and are not shown\n";
  }
  return note;
}

int PrintStores(tsd::Client& client, bool json) {
  auto listing = client.ListStores();
  if (!listing.ok()) {
    std::cerr << "tsctl: " << listing.status().message() << "\n";
    return 1;
  }
  const std::vector<tsd::StoreStatus>* stores = &listing->stores;
  const std::string note = NotShownNote(*listing);
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& s : *stores) {
      nlohmann::json devices = nlohmann::json::array();
      for (const auto& d : s.device_copies) {
        devices.push_back({{"gpu_uuid", d.gpu_uuid},
                           {"bytes", d.bytes},
                           {"users", d.users},
                           {"idle_s", d.idle_s}});
      }
      out.push_back({{"id", s.id},
                     {"source", s.source},
                     {"format", s.format},
                     {"block_size", s.block_size},
                     {"bytes", s.bytes},
                     {"users", s.users},
                     {"idle_s", s.idle_s},
                     {"digest", s.digest},
                     {"tensors", s.tensors},
                     {"device_copies", devices}});
    }
    std::cout << out.dump() << "\n";
    if (!note.empty()) std::cerr << "tsctl: note: " << note;  // stdout stays one JSON array
    return 0;
  }
  std::printf("%6s %-6s %12s %6s %8s  %s\n", "STORE", "FORMAT", "BYTES", "USERS", "IDLE", "SOURCE");
  for (const auto& s : *stores) {
    const std::string format =
        s.block_size == 0 ? s.format : s.format + "/" + std::to_string(s.block_size);
    const std::string idle = s.users > 0 ? "-" : std::to_string(static_cast<int>(s.idle_s)) + "s";
    std::printf("%6llu %-6s %12s %6u %8s  %s\n", static_cast<unsigned long long>(s.id),
                format.c_str(), tsd::wire::FormatBytes(s.bytes).c_str(), s.users, idle.c_str(),
                s.source.c_str());
    for (const auto& d : s.device_copies) {  // copies in VRAM (gpu_stores)
      const std::string didle =
          d.users > 0 ? "-" : std::to_string(static_cast<int>(d.idle_s)) + "s";
      std::printf("%6s %-6s %12s %6u %8s  on %s\n", "", "vram",
                  tsd::wire::FormatBytes(d.bytes).c_str(), d.users, didle.c_str(),
                  d.gpu_uuid.c_str());
    }
  }
  if (!note.empty()) std::printf("note: %s", note.c_str());
  return 0;
}

// --- tsctl top ---------------------------------------------------------------------------------

// What `tsctl top` shows and how often.
struct TopOptions {
  double interval_s = 1.0;
  int iterations = 0;         // frames to draw, 0 = until 'q' or Ctrl-C
  std::string sort = "used";  // used, quota, name, sessions, rate
  bool batch = false;         // plain frames one after another (also when stdout is no terminal)
};

volatile sig_atomic_t top_stop = 0;
void OnTopSignal(int) { top_stop = 1; }

// The terminal while `top` runs interactively: the alternate screen, no cursor, and keys read
// one at a time without echo. Everything is restored on destruction.
class TopTerminal {
 public:
  explicit TopTerminal(bool interactive) : interactive_(interactive) {
    if (!interactive_) return;
    if (isatty(STDIN_FILENO) && tcgetattr(STDIN_FILENO, &saved_) == 0) {
      termios raw = saved_;
      raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
      raw.c_cc[VMIN] = 0;
      raw.c_cc[VTIME] = 0;
      raw_ = tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
    }
    std::fputs("\x1b[?1049h\x1b[?25l", stdout);  // alternate screen, hide the cursor
    std::fflush(stdout);
  }
  ~TopTerminal() {
    if (!interactive_) return;
    std::fputs("\x1b[?25h\x1b[?1049l", stdout);
    std::fflush(stdout);
    if (raw_) tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  // Rows and columns (24x80 when unknown).
  static std::pair<int, int> Size() {
    winsize ws{};
    if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_row > 0 && ws.ws_col > 0) {
      return {ws.ws_row, ws.ws_col};
    }
    return {24, 80};
  }
  // Waits up to `seconds` for a key; returns it, or 0 on timeout or a signal.
  char WaitKey(double seconds) const {
    pollfd p{raw_ ? STDIN_FILENO : -1, POLLIN, 0};
    const int n = poll(&p, 1, static_cast<int>(seconds * 1000));
    char c = 0;
    if (n == 1 && (p.revents & POLLIN) && read(STDIN_FILENO, &c, 1) == 1) return c;
    return 0;
  }

 private:
  const bool interactive_;
  termios saved_{};
  bool raw_ = false;
};

std::string FormatUptime(double seconds) {
  const long s = static_cast<long>(seconds);
  char buf[64];
  if (s >= 86400) {
    std::snprintf(buf, sizeof(buf), "%ldd%02ldh%02ldm", s / 86400, s % 86400 / 3600, s % 3600 / 60);
  } else if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ldh%02ldm%02lds", s / 3600, s % 3600 / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ldm%02lds", s / 60, s % 60);
  }
  return buf;
}

// A signed byte rate for the RATE column: "+12.0 MiB/s", "-512 KiB/s", "0".
std::string FormatRate(double bytes_per_s) {
  if (std::fabs(bytes_per_s) < 0.5) return "0";
  std::string r = tsd::wire::FormatBytes(static_cast<uint64_t>(std::fabs(bytes_per_s))) + "/s";
  return (bytes_per_s < 0 ? "-" : "+") + r;
}

// One frame: the header and one row per job. `rates` is each job's change of used bytes per
// second since the previous frame.
std::vector<std::string> TopFrame(const std::string& socket, const tsd::PoolStatus& s,
                                  std::vector<tsd::JobStatus> jobs,
                                  const std::map<std::string, double>& rates,
                                  const std::string& sort) {
  std::sort(jobs.begin(), jobs.end(), [&](const tsd::JobStatus& a, const tsd::JobStatus& b) {
    auto rate = [&](const tsd::JobStatus& j) {
      auto it = rates.find(j.name);
      return it == rates.end() ? 0.0 : it->second;
    };
    if (sort == "name") return a.name < b.name;
    if (sort == "quota" && a.quota_bytes != b.quota_bytes) return a.quota_bytes > b.quota_bytes;
    if (sort == "sessions" && a.sessions != b.sessions) return a.sessions > b.sessions;
    if (sort == "rate" && rate(a) != rate(b)) return rate(a) > rate(b);
    if (a.used_bytes != b.used_bytes) return a.used_bytes > b.used_bytes;
    return a.name < b.name;
  });
  std::vector<std::string> out;
  char line[512];
  const std::time_t now = std::time(nullptr);
  char clock[16];
  std::strftime(clock, sizeof(clock), "%H:%M:%S", std::localtime(&now));
  std::snprintf(line, sizeof(line), "tsd %s (pid %u) at %s, up %s, %s", s.version.c_str(), s.pid,
                socket.c_str(), FormatUptime(s.uptime_s).c_str(), clock);
  out.push_back(line);
  const double pct = s.pool_bytes ? 100.0 * static_cast<double>(s.used_bytes) / s.pool_bytes : 0;
  std::snprintf(line, sizeof(line), "pool: %s used of %s (%.1f%%), %s, %s free; max job quota %s",
                tsd::wire::FormatBytes(s.used_bytes).c_str(),
                tsd::wire::FormatBytes(s.pool_bytes).c_str(), pct,
                s.locked ? "locked" : "NOT locked",
                tsd::wire::FormatBytes(s.pool_bytes - std::min(s.used_bytes, s.pool_bytes)).c_str(),
                tsd::wire::FormatBytes(s.max_job_quota_bytes).c_str());
  out.push_back(line);
  std::snprintf(line, sizeof(line), "jobs: %u, sessions: %u; sorted by %s", s.jobs, s.sessions,
                sort.c_str());
  out.push_back(line);
  out.push_back("");
  std::snprintf(line, sizeof(line), "%-32s %7s %5s %7s %12s %12s %6s %6s %13s", "JOB", "UID",
                "SESS", "REGIONS", "USED", "QUOTA", "%QUOTA", "%POOL", "RATE");
  out.push_back(line);
  for (const auto& j : jobs) {
    auto rate = rates.find(j.name);
    std::snprintf(line, sizeof(line), "%-32s %7u %5u %7u %12s %12s %6.1f %6.1f %13s",
                  j.name.c_str(), j.uid, j.sessions, j.regions,
                  tsd::wire::FormatBytes(j.used_bytes).c_str(),
                  tsd::wire::FormatBytes(j.quota_bytes).c_str(),
                  j.quota_bytes ? 100.0 * static_cast<double>(j.used_bytes) / j.quota_bytes : 0.0,
                  s.pool_bytes ? 100.0 * static_cast<double>(j.used_bytes) / s.pool_bytes : 0.0,
                  FormatRate(rate == rates.end() ? 0.0 : rate->second).c_str());
    out.push_back(line);
  }
  if (jobs.empty()) {
    out.push_back("(no jobs)");
    return out;
  }
  // What each job's optimizer is doing, in the same order.
  out.push_back("");
  for (std::string& l : tsd::tsctl::ActivityTable(jobs)) out.push_back(std::move(l));
  return out;
}

int RunTop(tsd::Client& client, TopOptions o) {
  const bool interactive = !o.batch && isatty(STDOUT_FILENO);
  struct sigaction sa {};
  sa.sa_handler = OnTopSignal;  // no SA_RESTART: the wait between frames ends at once
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  TopTerminal term(interactive);
  static const char* kSorts[] = {"used", "quota", "name", "sessions", "rate"};
  std::map<std::string, uint64_t> last_used;
  auto last_time = std::chrono::steady_clock::now();
  int rc = 0;
  for (int frame = 0; !top_stop && (o.iterations == 0 || frame < o.iterations); ++frame) {
    if (frame > 0) {
      // Wait for the next frame; keys: q quits, s cycles the sort order.
      const auto until =
          std::chrono::steady_clock::now() + std::chrono::duration<double>(o.interval_s);
      bool redraw = false;
      while (!top_stop && !redraw) {
        const double left =
            std::chrono::duration<double>(until - std::chrono::steady_clock::now()).count();
        if (left <= 0) break;
        const char key = interactive ? term.WaitKey(left) : 0;
        if (!interactive) poll(nullptr, 0, static_cast<int>(left * 1000));
        if (key == 'q' || key == 'Q') top_stop = 1;
        if (key == 's') {
          auto* it = std::find(std::begin(kSorts), std::end(kSorts), o.sort);
          o.sort = (it == std::end(kSorts) || it + 1 == std::end(kSorts)) ? kSorts[0] : *(it + 1);
          redraw = true;
        }
      }
      if (top_stop) break;
    }
    std::vector<std::string> lines;
    auto status = client.Status();
    auto jobs =
        status.ok() ? client.Jobs() : absl::StatusOr<std::vector<tsd::JobStatus>>(status.status());
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - last_time).count();
    if (status.ok() && jobs.ok()) {
      std::map<std::string, double> rates;
      std::map<std::string, uint64_t> used;
      for (const auto& j : *jobs) {
        used[j.name] = j.used_bytes;
        auto prev = last_used.find(j.name);
        if (prev != last_used.end() && dt > 0) {
          rates[j.name] =
              (static_cast<double>(j.used_bytes) - static_cast<double>(prev->second)) / dt;
        }
      }
      last_used = std::move(used);
      last_time = now;
      lines = TopFrame(client.socket_path(), *status, *jobs, rates, o.sort);
    } else {
      const absl::Status err = status.ok() ? jobs.status() : status.status();
      if (!interactive) {
        std::cerr << "tsctl: " << err.message() << "\n";
        return 1;
      }
      lines = {"tsctl top: " + std::string(err.message()), "", "retrying every interval; q quits"};
      rc = 1;
    }
    if (!interactive) {
      for (const auto& l : lines) std::printf("%s\n", l.c_str());
      std::printf("\n");
      std::fflush(stdout);
      continue;
    }
    rc = status.ok() && jobs.ok() ? 0 : rc;
    const auto [rows, cols] = TopTerminal::Size();
    std::string out = "\x1b[H";  // home; each line is cleared to its end, then the rest below
    for (int i = 0; i < static_cast<int>(lines.size()) && i < rows - 1; ++i) {
      std::string l = lines[i].substr(0, static_cast<size_t>(cols));
      if (i == 4)
        l = "\x1b[7m" + l + std::string(static_cast<size_t>(cols) - l.size(), ' ') + "\x1b[0m";
      out += l + "\x1b[K\n";
    }
    const int hidden = static_cast<int>(lines.size()) - (rows - 1);
    if (hidden > 0) out += "(" + std::to_string(hidden) + " more jobs)\x1b[K";
    out += "\x1b[J";
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
  }
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tsctl: inspect a running TrainStream daemon (tsd)", "tsctl"};
  std::string socket;
  app.add_option("--socket", socket, "tsd's socket (default $TSD_SOCKET, else tsd's default path)");
  app.require_subcommand(1);
  bool status_json = false, jobs_json = false, stores_json = false;
  auto* status =
      app.add_subcommand("status", "the pool: version, uptime, bytes, locked, jobs, sessions");
  status->add_flag(
      "--json", status_json,
      "one JSON object: version, uptime, pool_bytes, used_bytes, locked, jobs, sessions");
  auto* jobs = app.add_subcommand("jobs", "every job: name, uid, sessions, used and quota bytes");
  jobs->add_flag(
      "--json", jobs_json,
      "a JSON array of {name, uid, sessions, used_bytes, quota_bytes, numa_node, activity}; "
      "numa_node: the NUMA node tsd placed the job on (null: none); "
      "activity (null without an optimizer): {steps, params, params_updated, "
      "bucket_updates, steps_per_s, params_per_s, bucket_update_p50_s, "
      "bucket_update_p99_s, moment_dtype, client_reports, step_wait_s, "
      "h2d_bytes_per_step, d2h_bytes_per_step}");
  auto* stores = app.add_subcommand(
      "stores",
      "the weight stores your jobs opened (all of them for tsd's own uid): id, format, bytes, "
      "users, idle time, source files; a note counts the stores of other users, not shown");
  stores->add_flag("--json", stores_json,
                   "a JSON array of {id, source, format, block_size, bytes, users, idle_s, "
                   "digest, tensors, device_copies}; the note goes to stderr");
  TopOptions top_options;
  auto* top = app.add_subcommand(
      "top",
      "a live view of the pool and every job (memory, then what its optimizer is doing: steps, "
      "parameters updated, bucket update latency, wait in step(), paging, moment dtype), redrawn "
      "in place (q quits, s changes the sort)");
  top->add_option("-d,--interval", top_options.interval_s, "seconds between frames (default 1)")
      ->check(CLI::Range(0.05, 3600.0));
  top->add_option("-n,--iterations", top_options.iterations,
                  "frames to draw, then exit (default: until q)")
      ->check(CLI::NonNegativeNumber);
  top->add_option("--sort", top_options.sort,
                  "order of jobs: used (default), quota, name, sessions, rate")
      ->check(CLI::IsMember({"used", "quota", "name", "sessions", "rate"}));
  top->add_flag("-b,--batch", top_options.batch,
                "print frames one after another instead of redrawing (the default when stdout is "
                "no terminal)");
  std::string checkpoint_job, checkpoint_file;
  auto* checkpoint = app.add_subcommand(
      "checkpoint",
      "write JOB's optimizer state into FILE (a job of yours; tsd writes into a temporary file "
      "tsctl opened beside FILE, then tsctl fsyncs and renames it; checksums are verified on "
      "load)");
  checkpoint->add_option("JOB", checkpoint_job, "the job (see tsctl jobs)")->required();
  checkpoint->add_option("FILE", checkpoint_file, "where to put the state (safetensors)")
      ->required();
  CLI11_PARSE(app, argc, argv);

  auto client = tsd::Client::Connect(socket);
  if (!client.ok()) {
    if ((*status && status_json) || (*jobs && jobs_json)) {
      // A script asked for JSON: it gets JSON on stdout, with the reason, and the exit code.
      const nlohmann::json error = {{"error", std::string(client.status().message())},
                                    {"code", absl::StatusCodeToString(client.status().code())},
                                    {"running", false}};
      std::cout << error.dump() << "\n";
    }
    std::cerr << "tsctl: " << client.status().message() << "\n";
    return 1;
  }
  if (*status) return PrintStatus(**client, status_json);
  if (*top) return RunTop(**client, top_options);
  if (*stores) return PrintStores(**client, stores_json);
  if (*checkpoint) return tsd::tools::Checkpoint(**client, checkpoint_job, checkpoint_file);
  return PrintJobs(**client, jobs_json);
}
