// StepStats is what `tsctl top` and `tsctl jobs --json` show of a job's optimizer: how many steps
// and parameter updates it has done, how fast it is going now, and how long its bucket updates
// take. The job's engine records into it (JobOptimizer: every bucket update, every step); the
// control plane reads a Snapshot when it lists the jobs.
//
// Bucket updates are recorded per bucket, on the engine's hot path, so that part takes no lock:
// atomic counters, and a latency histogram of fixed log-spaced bins (four per octave from 1 us,
// so a percentile is within 19% of the truth) in two generations of 10 seconds each, so the
// percentiles describe the last 10 to 20 seconds in which the job stepped, not its whole life. A
// generation is cleared by the first update that finds it stale; an update racing with the clear
// may be lost, which a percentile does not notice.
//
// Steps come once per step (not per bucket), so the rate keeps a small ring of the last steps'
// times under a mutex: steps per second is the steps of the ring over the time from its oldest
// to now, which follows a job's pace within a few steps and decays to 0 once it stops. The ring
// also keeps the engine's busy time at each step (the seconds its threads spent on the job), so
// the busy time per second over the same span says how much of the threads the job takes now.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "proto/mutex.h"

namespace tsd {

class StepStats final {
 public:
  using Clock = std::chrono::steady_clock;

  // Four bins per octave from 1 us: bin i holds latencies in [2^(i/4), 2^((i+1)/4)) us; the last
  // also holds everything longer (2^26 us is about 67 s).
  static constexpr int kBins = 104;
  static constexpr int kRing = 64;  // steps the rate is measured over
  static constexpr int64_t kGenerationNs = 10'000'000'000;

  struct Snapshot {
    uint64_t steps = 0;           // optimizer steps completed
    uint64_t params_updated = 0;  // parameters updated, over all bucket updates
    uint64_t bucket_updates = 0;
    double steps_per_s = 0;
    double params_per_s = 0;
    double busy_s_per_s =
        0;  // the threads' seconds on the job per second (over their count: a share)
    // Over the bucket updates of the last 10-20 s that had any; 0 when there were none.
    uint64_t latency_samples = 0;
    double bucket_update_p50_s = 0;
    double bucket_update_p99_s = 0;
  };

  StepStats() = default;
  StepStats(const StepStats&) = delete;
  StepStats& operator=(const StepStats&) = delete;

  // One bucket update of `params` parameters took `seconds`. Lock-free.
  void RecordBucket(double seconds, uint64_t params, Clock::time_point now = Clock::now());
  // The job completed optimizer step `step`; its threads had then spent `busy_ns` on it in all.
  void RecordStep(int64_t step, Clock::time_point now = Clock::now(), uint64_t busy_ns = 0)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `busy_ns`: the threads' time on the job in all, now (the same count RecordStep was given).
  Snapshot Read(Clock::time_point now = Clock::now(), uint64_t busy_ns = 0) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // The bin of a latency, and the latency a bin stands for (its geometric middle).
  static int Bin(double seconds);
  static double BinSeconds(int bin);

 private:
  struct Generation {
    std::atomic<int64_t> epoch{-1};  // which 10-second window the counts belong to
    std::array<std::atomic<uint64_t>, kBins> counts{};
  };
  struct Mark {
    Clock::time_point at;
    uint64_t params = 0;   // params_updated when the step completed
    uint64_t busy_ns = 0;  // the threads' time on the job by then
  };

  std::atomic<uint64_t> steps_{0};
  std::atomic<uint64_t> params_{0};
  std::atomic<uint64_t> updates_{0};
  std::array<Generation, 2> generations_;

  mutable Mutex mu_;
  std::array<Mark, kRing> ring_ ABSL_GUARDED_BY(mu_);
  uint64_t marks_ ABSL_GUARDED_BY(mu_) = 0;  // marks ever written; the newest is (marks_-1)%kRing
};

}  // namespace tsd
