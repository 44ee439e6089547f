// The Metrics class on its own: what the optimizer engine's observer calls export, that pool and
// job figures come from the Registry at each scrape, and that a released job's series go away
// (but not while an observer of them is held).
#include "daemon/ops/metrics.h"

#include <unistd.h>

#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/jobs/registry.h"

namespace tsd {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A registry with one live job, `name` (attached as the side socket would); `*session` is its
// session.
std::unique_ptr<Registry> RegistryWithJob(const std::string& name, uint64_t* session) {
  RegistryOptions o;
  o.pool_bytes = 64 << 20;
  o.max_job_quota_bytes = 32 << 20;
  auto r = std::make_unique<Registry>(o);
  auto attached = r->Attach(name, 0, getuid(), getpid());
  EXPECT_TRUE(attached.ok());
  *session = attached.ok() ? attached->session_id : 0;
  return r;
}

TEST(Metrics, PoolAndJobFiguresComeFromTheRegistry) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  ASSERT_TRUE(registry->Alloc(ref, "r", 1 << 20).ok());
  Metrics metrics(*registry, /*per_job=*/true);
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("tsd_pool_bytes 67108864\n"));
  EXPECT_THAT(text, HasSubstr("tsd_pool_used_bytes 1048576\n"));
  EXPECT_THAT(text, HasSubstr("tsd_max_job_quota_bytes 33554432\n"));
  EXPECT_THAT(text, HasSubstr("tsd_jobs 1\n"));
  EXPECT_THAT(text, HasSubstr("tsd_sessions 1\n"));
  EXPECT_THAT(text, HasSubstr("tsd_job_used_bytes{job_name=\"job-a\"} 1048576\n"));
  EXPECT_THAT(text, HasSubstr("tsd_job_quota_bytes{job_name=\"job-a\"} 33554432\n"));
  EXPECT_THAT(text, HasSubstr("tsd_job_regions{job_name=\"job-a\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("tsd_pool_locked_bytes 0\n"));  // lock_memory is off here
  EXPECT_THAT(text, HasSubstr("# TYPE tsd_pool_bytes gauge\n"));
  EXPECT_EQ(metrics.port(), 0);  // not listening
}

TEST(Metrics, OptimizerRecordsAreCountersAndAHistogram) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  Metrics metrics(*registry, /*per_job=*/true);
  auto observer = metrics.ObserverFor("job-a");
  observer->OnBucketUpdate(0.0003, 1000);
  observer->OnBucketUpdate(0.002, 500);
  observer->OnStep(1);
  observer->OnStep(2);
  metrics.ObserverFor("job-a")->OnStep(3);  // a second observer of the job adds to the same series
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE tsd_optimizer_steps_total counter\n"));
  EXPECT_THAT(text, HasSubstr("tsd_optimizer_steps_total{job_name=\"job-a\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("tsd_optimizer_params_total{job_name=\"job-a\"} 1500\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE tsd_bucket_update_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr("tsd_bucket_update_seconds_count{job_name=\"job-a\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("tsd_bucket_update_seconds_sum{job_name=\"job-a\"} 0.0023"));
  EXPECT_THAT(text,
              HasSubstr("tsd_bucket_update_seconds_bucket{job_name=\"job-a\",le=\"0.00025\"} 0\n"));
  EXPECT_THAT(text,
              HasSubstr("tsd_bucket_update_seconds_bucket{job_name=\"job-a\",le=\"0.0005\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("tsd_bucket_update_seconds_bucket{job_name=\"job-a\",le=\"+Inf\"} 2\n"));
}

TEST(Metrics, AReleasedJobsSeriesGoAtTheNextScrape) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  Metrics metrics(*registry, /*per_job=*/true);
  metrics.ObserverFor("job-a")->OnStep(1);
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_optimizer_steps_total{job_name=\"job-a\"} 1\n"));
  ASSERT_TRUE(registry->Detach(ref).ok());  // the last session: the job is released
  const std::string text = metrics.Render();
  EXPECT_THAT(text, Not(HasSubstr("job-a")));
  EXPECT_THAT(text, HasSubstr("tsd_jobs 0\n"));
  // Series of a job the registry does not hold are dropped by the next scrape too.
  metrics.ObserverFor("job-b")->OnStep(1);
  EXPECT_THAT(metrics.Render(), Not(HasSubstr("job-b")));
}

// An optimizer may outlive its job's entry in the registry for a moment (work in flight): its
// observer keeps the series, so it never records into a removed metric, and they go once it ends.
TEST(Metrics, AHeldObserverKeepsItsSeriesUntilItIsDropped) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  Metrics metrics(*registry, /*per_job=*/true);
  auto observer = metrics.ObserverFor("job-a");
  ASSERT_TRUE(registry->Detach(ref).ok());  // the job is released, its optimizer not yet gone
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_optimizer_steps_total{job_name=\"job-a\"} 0\n"));
  observer->OnStep(1);
  observer->OnBucketUpdate(0.001, 10);
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_optimizer_steps_total{job_name=\"job-a\"} 1\n"));
  observer.reset();
  EXPECT_THAT(metrics.Render(), Not(HasSubstr("job-a")));
}

TEST(Metrics, BeforeARegistryIsWatchedOnlyTheOptimizerIsExported) {
  Metrics metrics(/*per_job=*/true);  // as the daemon makes it, before its Registry
  metrics.ObserverFor("early")->OnStep(1);
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("tsd_build_info{version="));
  EXPECT_THAT(text, HasSubstr("tsd_optimizer_steps_total{job_name=\"early\"} 1\n"));
  EXPECT_THAT(text, Not(HasSubstr("tsd_pool_bytes")));
  uint64_t ref = 0;
  auto registry = RegistryWithJob("early", &ref);
  metrics.WatchRegistry(*registry);
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_pool_bytes 67108864\n"));
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_optimizer_steps_total{job_name=\"early\"} 1\n"));
  metrics.StopServing();
}

// Without per-job series (the default) no job is named: the optimizer's records of every job go
// to one unlabelled series, which stays when jobs go.
TEST(Metrics, AggregatesOnlyByDefault) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  ASSERT_TRUE(registry->Alloc(ref, "r", 1 << 20).ok());
  Metrics metrics(*registry);
  metrics.ObserverFor("job-a")->OnStep(1);
  metrics.ObserverFor("job-b")->OnStep(2);
  const std::string text = metrics.Render();
  EXPECT_THAT(text, Not(HasSubstr("job-a")));
  EXPECT_THAT(text, Not(HasSubstr("tsd_job_")));
  EXPECT_THAT(text, HasSubstr("tsd_optimizer_steps_total 2\n"));
  EXPECT_THAT(text, HasSubstr("tsd_regions 1\n"));
  EXPECT_THAT(text, HasSubstr("tsd_pool_used_bytes 1048576\n"));
  ASSERT_TRUE(registry->Detach(ref).ok());
  EXPECT_THAT(metrics.Render(), HasSubstr("tsd_optimizer_steps_total 2\n"));
}

TEST(Metrics, ListenReportsAPortAndATakenOneIsAnError) {
  uint64_t ref = 0;
  auto registry = RegistryWithJob("job-a", &ref);
  Metrics first(*registry);
  ASSERT_TRUE(first.Listen("127.0.0.1:0").ok());
  ASSERT_GT(first.port(), 0);
  Metrics second(*registry);
  const absl::Status taken = second.Listen("127.0.0.1:" + std::to_string(first.port()));
  EXPECT_EQ(taken.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(taken.message()), HasSubstr("metrics_listen"));
}

}  // namespace
}  // namespace tsd
