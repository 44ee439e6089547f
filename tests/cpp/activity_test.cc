// What `tsctl top` and `tsctl jobs --json` show of a job's optimizer (JobActivity): steps and
// parameters updated counted by the daemon's engine, bucket update latency percentiles, the
// moment dtype, and what the client reports of its steps on the control page.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "daemon_process.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kSmall = 1000, kLarge = 200000;  // the large bucket runs chunked on the pool

std::unique_ptr<Optimizer> Register(Client& c, DType moments = DType::kF32) {
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, kSmall, DType::kF32, DType::kF32}, {0, kLarge, DType::kF32, DType::kF32}};
  spec.moment_dtype = moments;
  auto opt = c.RegisterOptimizer(spec);
  EXPECT_TRUE(opt.ok()) << opt.status();
  return opt.ok() ? std::move(*opt) : nullptr;
}

void Step(Optimizer& opt, int n) {
  for (int i = 0; i < n; ++i) {
    for (size_t b = 0; b < opt.num_buckets(); ++b) ASSERT_TRUE(opt.Ready(b).ok());
    ASSERT_TRUE(opt.WaitAll().ok());
  }
}

const JobStatus* Find(const std::vector<JobStatus>& jobs, const std::string& name) {
  for (const auto& j : jobs) {
    if (j.name == name) return &j;
  }
  return nullptr;
}

TEST(Activity, CountsMatchTheStepsTaken) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect(), idle = d->Connect();
  ASSERT_TRUE(c->Attach("act-steps").ok());
  ASSERT_TRUE(idle->Attach("act-no-optimizer").ok());
  auto opt = Register(*c, DType::kBF16);
  ASSERT_TRUE(opt);
  constexpr int kSteps = 7;
  Step(*opt, kSteps);

  auto jobs = c->Jobs();
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  const JobStatus* none = Find(*jobs, "act-no-optimizer");
  ASSERT_NE(none, nullptr);
  EXPECT_FALSE(none->has_optimizer);
  const JobStatus* j = Find(*jobs, "act-steps");
  ASSERT_NE(j, nullptr);
  ASSERT_TRUE(j->has_optimizer);
  const JobStatus::Activity& a = j->activity;
  EXPECT_EQ(a.steps, static_cast<uint64_t>(kSteps));
  EXPECT_EQ(a.params, kSmall + kLarge);
  EXPECT_EQ(a.params_updated, kSteps * (kSmall + kLarge));
  EXPECT_EQ(a.bucket_updates, 2u * kSteps);
  EXPECT_EQ(a.moment_dtype, "BF16");
  EXPECT_GT(a.steps_per_s, 0);
  EXPECT_GT(a.params_per_s, 0);
  // Percentiles are present and ordered.
  EXPECT_GT(a.bucket_update_p50_s, 0);
  EXPECT_GE(a.bucket_update_p99_s, a.bucket_update_p50_s);
  EXPECT_LT(a.bucket_update_p99_s, 10);
  // The client has reported nothing yet.
  EXPECT_EQ(a.client_reports, 0u);
  EXPECT_EQ(a.client_step_wait_s, 0);
}

TEST(Activity, TheClientsReportIsShown) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("act-report").ok());
  auto opt = Register(*c);
  ASSERT_TRUE(opt);
  Step(*opt, 2);
  ASSERT_TRUE(opt->ReportStep(absl::Microseconds(1500), 3 << 20, 1 << 20).ok());
  ASSERT_TRUE(opt->ReportStep(absl::Microseconds(2500), 5 << 20, 2 << 20).ok());
  // A negative wait is refused and changes nothing.
  const absl::Status bad = opt->ReportStep(absl::Milliseconds(-1), 1, 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("negative"));

  auto jobs = c->Jobs();
  ASSERT_TRUE(jobs.ok());
  const JobStatus* j = Find(*jobs, "act-report");
  ASSERT_NE(j, nullptr);
  EXPECT_EQ(j->activity.client_reports, 2u);
  EXPECT_NEAR(j->activity.client_step_wait_s, 0.0025, 1e-9);
  EXPECT_EQ(j->activity.client_h2d_bytes, 5u << 20);
  EXPECT_EQ(j->activity.client_d2h_bytes, 2u << 20);
  EXPECT_EQ(j->activity.moment_dtype, "F32");
}

TEST(Activity, TsctlShowsIt) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect(), idle = d->Connect();
  ASSERT_TRUE(c->Attach("act-tsctl").ok());
  ASSERT_TRUE(idle->Attach("act-tsctl-idle").ok());
  auto opt = Register(*c);
  ASSERT_TRUE(opt);
  Step(*opt, 5);
  ASSERT_TRUE(opt->ReportStep(absl::Milliseconds(3), 2 << 20, 0).ok());
  const std::string tsctl = std::string(TSCTL_BINARY) + " --socket " + d->socket();

  int rc = 0;
  const std::string text = RunCommand(tsctl + " jobs --json", &rc);
  ASSERT_EQ(rc, 0) << text;
  const auto jobs = nlohmann::json::parse(text);
  ASSERT_EQ(jobs.size(), 2u) << text;
  for (const auto& j : jobs) {
    if (j["name"] == "act-tsctl-idle") {
      EXPECT_TRUE(j["activity"].is_null()) << j;
      continue;
    }
    const auto& a = j["activity"];
    EXPECT_EQ(a["steps"], 5) << a;
    EXPECT_EQ(a["params_updated"], 5 * (kSmall + kLarge)) << a;
    EXPECT_EQ(a["bucket_updates"], 10) << a;
    EXPECT_EQ(a["moment_dtype"], "F32") << a;
    EXPECT_GT(a["steps_per_s"].get<double>(), 0) << a;
    EXPECT_GT(a["params_per_s"].get<double>(), 0) << a;
    EXPECT_GT(a["bucket_update_p50_s"].get<double>(), 0) << a;
    EXPECT_GE(a["bucket_update_p99_s"].get<double>(), a["bucket_update_p50_s"].get<double>());
    EXPECT_DOUBLE_EQ(a["step_wait_s"].get<double>(), 0.003) << a;
    EXPECT_EQ(a["h2d_bytes_per_step"], 2 << 20) << a;
    EXPECT_EQ(a["d2h_bytes_per_step"], 0) << a;
    EXPECT_EQ(a["speculated_commits"], 0) << a;  // no clipping here (speculation_test.cc counts)
    EXPECT_EQ(a["redone_commits"], 0) << a;
    // Five steps of two buckets were worked on (the small one on the dispatcher, the large one
    // on the pool), and no longer than the test has run with every thread busy.
    EXPECT_GT(a["work_busy_s"].get<double>(), 0) << a;
    EXPECT_LT(a["work_busy_s"].get<double>(), 60.0 * std::thread::hardware_concurrency()) << a;
    EXPECT_GE(a["work_busy_share"].get<double>(), 0) << a;
    EXPECT_LE(a["work_busy_share"].get<double>(), 1.0) << a;
  }

  // top: the activity table, one row per job in the memory table's order.
  const std::string top = RunCommand(tsctl + " top -n 1 2>&1", &rc);
  ASSERT_EQ(rc, 0) << top;
  const size_t table = top.find("STEP/S");
  ASSERT_NE(table, std::string::npos) << top;
  EXPECT_THAT(top, HasSubstr("PARAM/S"));
  EXPECT_THAT(top, HasSubstr("UPD P99"));
  // JOB STEPS STEP/S PARAM/S P50 P99 WAIT H2D/STEP(2 words) D2H/STEP(2 words) MOMENTS BUSY
  std::istringstream row(top.substr(top.find("act-tsctl ", table)));
  std::string job, steps, rate, params, p50, p99, wait, h2d, h2d_unit, d2h, d2h_unit, moments, busy;
  row >> job >> steps >> rate >> params >> p50 >> p99 >> wait >> h2d >> h2d_unit >> d2h >>
      d2h_unit >> moments >> busy;
  EXPECT_THAT(busy, ::testing::MatchesRegex("[0-9]+%")) << top;
  EXPECT_EQ(job + " " + steps, "act-tsctl 5") << top;
  EXPECT_EQ(wait, "3.0ms") << top;
  EXPECT_EQ(h2d + h2d_unit, "2MiB") << top;
  EXPECT_EQ(moments, "F32") << top;
  std::istringstream idle_row(top.substr(top.find("act-tsctl-idle", table)));
  std::string idle_job, dash;
  idle_row >> idle_job >> dash;
  EXPECT_EQ(dash, "-") << top;
}

}  // namespace
}  // namespace tsd::testing
