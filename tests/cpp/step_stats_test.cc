// StepStats: the counters, the latency percentiles and the step rate `tsctl top` shows.
#include "daemon/optimizer/step_stats.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

namespace tsd {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(StepStats, BinsAreOrderedAndWithinAQuarterOctave) {
  EXPECT_EQ(StepStats::Bin(0), 0);
  EXPECT_EQ(StepStats::Bin(-1), 0);
  EXPECT_EQ(StepStats::Bin(1e9), StepStats::kBins - 1);
  int last = 0;
  for (double s = 1e-6; s < 30; s *= 1.07) {
    const int b = StepStats::Bin(s);
    EXPECT_GE(b, last);
    last = b;
    // The bin's representative value is within one bin width (2^(1/4)) of the latency.
    EXPECT_LT(StepStats::BinSeconds(b) / s, 1.19) << s;
    EXPECT_GT(StepStats::BinSeconds(b) / s, 1 / 1.19) << s;
  }
}

TEST(StepStats, CountsAndPercentiles) {
  StepStats stats;
  const auto t0 = StepStats::Clock::now();
  // 98 fast updates (100 us), 2 slow ones (50 ms): p50 is fast, p99 slow.
  for (int i = 0; i < 98; ++i) stats.RecordBucket(100e-6, 10, t0);
  stats.RecordBucket(0.05, 10, t0);
  stats.RecordBucket(0.05, 10, t0);
  const StepStats::Snapshot s = stats.Read(t0);
  EXPECT_EQ(s.bucket_updates, 100u);
  EXPECT_EQ(s.params_updated, 1000u);
  EXPECT_EQ(s.latency_samples, 100u);
  EXPECT_NEAR(s.bucket_update_p50_s, 100e-6, 20e-6);
  EXPECT_NEAR(s.bucket_update_p99_s, 0.05, 0.01);
  EXPECT_LE(s.bucket_update_p50_s, s.bucket_update_p99_s);
}

TEST(StepStats, PercentilesForgetOldWindows) {
  StepStats stats;
  const auto t0 = StepStats::Clock::now();
  for (int i = 0; i < 10; ++i) stats.RecordBucket(0.5, 1, t0);
  // Two generations later the slow updates are gone from the percentiles (not from the counts).
  const auto later = t0 + seconds(25);
  for (int i = 0; i < 10; ++i) stats.RecordBucket(1e-3, 1, later);
  const StepStats::Snapshot s = stats.Read(later);
  EXPECT_EQ(s.bucket_updates, 20u);
  EXPECT_NEAR(s.bucket_update_p99_s, 1e-3, 2e-4);
}

TEST(StepStats, RateFollowsThePaceAndDecaysWhenStopped) {
  StepStats stats;
  const auto t0 = StepStats::Clock::now();
  EXPECT_EQ(stats.Read(t0).steps_per_s, 0);
  // 100 steps, 25 ms apart (40 steps/s), each updating 1000 parameters.
  // The threads spend 10 ms of each 25 ms step on the job: 0.4 s of their time per second.
  const uint64_t busy_per_step = 10'000'000;
  for (int step = 1; step <= 100; ++step) {
    const auto at = t0 + milliseconds(25 * step);
    stats.RecordBucket(1e-4, 1000, at);
    stats.RecordStep(step, at, busy_per_step * static_cast<uint64_t>(step));
  }
  const auto end = t0 + milliseconds(2500);
  StepStats::Snapshot s = stats.Read(end, busy_per_step * 100);
  EXPECT_EQ(s.steps, 100u);
  EXPECT_NEAR(s.steps_per_s, 40, 0.5);
  EXPECT_NEAR(s.params_per_s, 40000, 500);
  EXPECT_NEAR(s.busy_s_per_s, 0.4, 0.01);
  // Ten seconds after the last step the rates have fallen well below the pace.
  s = stats.Read(end + seconds(10), busy_per_step * 100);
  EXPECT_LT(s.steps_per_s, 6);
  EXPECT_GT(s.steps_per_s, 0);
  EXPECT_LT(s.busy_s_per_s, 0.06);
  // Busy time that went backwards (a count the engine never gives) reads as none, not as a wrap.
  EXPECT_EQ(stats.Read(end, 0).busy_s_per_s, 0);
}

TEST(StepStats, ConcurrentRecordingLosesNoCount) {
  StepStats stats;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) stats.RecordBucket(2e-5, 3);
    });
  }
  for (auto& t : threads) t.join();
  const StepStats::Snapshot s = stats.Read();
  EXPECT_EQ(s.bucket_updates, 40000u);
  EXPECT_EQ(s.params_updated, 120000u);
}

}  // namespace
}  // namespace tsd
