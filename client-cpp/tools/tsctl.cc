// tsctl: inspect a running tsd. `tsctl status` shows the pool, `tsctl jobs` the jobs on it;
// `--json` prints machine-readable output with stable keys.
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "proto/wire.h"
#include "tsd/client.h"

namespace {

int PrintStatus(tsd::Client& client, bool json) {
  auto s = client.Status();
  if (!s.ok()) {
    std::cerr << "tsctl: " << s.status().message() << "\n";
    return 1;
  }
  if (json) {
    nlohmann::json j = {{"version", s->version}, {"uptime", s->uptime_s}, {"pool_bytes", s->pool_bytes},
                        {"used_bytes", s->used_bytes}, {"locked", s->locked}, {"jobs", s->jobs},
                        {"sessions", s->sessions}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("tsd %s (pid %u) at %s, up %.0f s\n", s->version.c_str(), s->pid, client.socket_path().c_str(),
              s->uptime_s);
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
      out.push_back({{"name", j.name}, {"uid", j.uid}, {"sessions", j.sessions}, {"used_bytes", j.used_bytes},
                     {"quota_bytes", j.quota_bytes}});
    }
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::printf("%-32s %8s %8s %12s %12s\n", "JOB", "UID", "SESSIONS", "USED", "QUOTA");
  for (const auto& j : *jobs) {
    std::printf("%-32s %8u %8u %12s %12s\n", j.name.c_str(), j.uid, j.sessions,
                tsd::wire::FormatBytes(j.used_bytes).c_str(), tsd::wire::FormatBytes(j.quota_bytes).c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tsctl: inspect a running TrainStream daemon (tsd)", "tsctl"};
  std::string socket;
  app.add_option("--socket", socket, "tsd's socket (default $TSD_SOCKET, else tsd's default path)");
  app.require_subcommand(1);
  bool status_json = false, jobs_json = false;
  auto* status = app.add_subcommand("status", "the pool: version, uptime, bytes, locked, jobs, sessions");
  status->add_flag("--json", status_json,
                   "one JSON object: version, uptime, pool_bytes, used_bytes, locked, jobs, sessions");
  auto* jobs = app.add_subcommand("jobs", "every job: name, uid, sessions, used and quota bytes");
  jobs->add_flag("--json", jobs_json, "a JSON array of {name, uid, sessions, used_bytes, quota_bytes}");
  CLI11_PARSE(app, argc, argv);

  auto client = tsd::Client::Connect(socket);
  if (!client.ok()) {
    std::cerr << "tsctl: " << client.status().message() << "\n";
    return 1;
  }
  if (*status) return PrintStatus(**client, status_json);
  return PrintJobs(**client, jobs_json);
}
