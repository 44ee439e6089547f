#include "client-cpp/tools/activity_view.h"

#include <cmath>
#include <cstdio>

#include "proto/wire.h"

namespace tsd::tsctl {

std::string FormatSeconds(double s) {
  char buf[32];
  if (!(s > 0)) return "0";
  if (s < 1e-3) {
    std::snprintf(buf, sizeof(buf), "%.0fus", s * 1e6);
  } else if (s < 1) {
    std::snprintf(buf, sizeof(buf), "%.1fms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2fs", s);
  }
  return buf;
}

std::string FormatCount(double n) {
  char buf[32];
  if (n < 1e3) {
    std::snprintf(buf, sizeof(buf), "%.0f", n);
  } else if (n < 1e6) {
    std::snprintf(buf, sizeof(buf), "%.1fK", n / 1e3);
  } else if (n < 1e9) {
    std::snprintf(buf, sizeof(buf), "%.2fM", n / 1e6);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2fG", n / 1e9);
  }
  return buf;
}

std::vector<std::string> ActivityTable(const std::vector<JobStatus>& jobs) {
  std::vector<std::string> out;
  char line[512];
  const char* fmt = "%-32s %9s %8s %9s %8s %8s %8s %10s %10s %7s %5s";
  std::snprintf(line, sizeof(line), fmt, "JOB", "STEPS", "STEP/S", "PARAM/S", "UPD P50", "UPD P99",
                "WAIT", "H2D/STEP", "D2H/STEP", "MOMENTS", "BUSY");
  out.push_back(line);
  for (const JobStatus& j : jobs) {
    if (!j.has_optimizer) {
      std::snprintf(line, sizeof(line), fmt, j.name.c_str(), "-", "-", "-", "-", "-", "-", "-", "-",
                    "-", "-");
      out.push_back(line);
      continue;
    }
    const JobStatus::Activity& a = j.activity;
    const bool reported = a.client_reports > 0;
    const bool timed = a.bucket_update_p50_s > 0;
    char rate[32], busy[32];
    std::snprintf(rate, sizeof(rate), "%.1f", a.steps_per_s);
    std::snprintf(busy, sizeof(busy), "%.0f%%", 100 * a.work_busy_share);
    std::snprintf(line, sizeof(line), fmt, j.name.c_str(), std::to_string(a.steps).c_str(), rate,
                  FormatCount(a.params_per_s).c_str(),
                  timed ? FormatSeconds(a.bucket_update_p50_s).c_str() : "-",
                  timed ? FormatSeconds(a.bucket_update_p99_s).c_str() : "-",
                  reported ? FormatSeconds(a.client_step_wait_s).c_str() : "-",
                  reported ? wire::FormatBytes(a.client_h2d_bytes).c_str() : "-",
                  reported ? wire::FormatBytes(a.client_d2h_bytes).c_str() : "-",
                  a.moment_dtype.c_str(), busy);
    out.push_back(line);
  }
  return out;
}

nlohmann::json ActivityJson(const JobStatus& job) {
  if (!job.has_optimizer) return nullptr;
  const JobStatus::Activity& a = job.activity;
  const bool reported = a.client_reports > 0;
  auto reported_or_null = [&](const nlohmann::json& v) {
    return reported ? v : nlohmann::json(nullptr);
  };
  return {{"steps", a.steps},
          {"params", a.params},
          {"params_updated", a.params_updated},
          {"bucket_updates", a.bucket_updates},
          {"steps_per_s", a.steps_per_s},
          {"params_per_s", a.params_per_s},
          {"bucket_update_p50_s", a.bucket_update_p50_s},
          {"bucket_update_p99_s", a.bucket_update_p99_s},
          {"moment_dtype", a.moment_dtype},
          {"client_reports", a.client_reports},
          {"step_wait_s", reported_or_null(a.client_step_wait_s)},
          {"h2d_bytes_per_step", reported_or_null(a.client_h2d_bytes)},
          {"d2h_bytes_per_step", reported_or_null(a.client_d2h_bytes)},
          {"speculated_commits", a.speculated_commits},
          {"redone_commits", a.redone_commits},
          {"work_busy_s", a.work_busy_s},
          {"work_busy_share", a.work_busy_share}};
}

}  // namespace tsd::tsctl
