#include "daemon/optimizer/step_stats.h"

#include <algorithm>
#include <cmath>

namespace tsd {

int StepStats::Bin(double seconds) {
  const double us = seconds * 1e6;
  if (!(us >= 1)) return 0;  // also NaN
  const int bin = static_cast<int>(std::floor(4 * std::log2(us)));
  return std::clamp(bin, 0, kBins - 1);
}

double StepStats::BinSeconds(int bin) { return std::exp2((bin + 0.5) / 4) * 1e-6; }

void StepStats::RecordBucket(double seconds, uint64_t params, Clock::time_point now) {
  params_.fetch_add(params, std::memory_order_relaxed);
  updates_.fetch_add(1, std::memory_order_relaxed);
  const int64_t epoch =
      now.time_since_epoch().count() /
      std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(kGenerationNs)).count();
  Generation& g = generations_[static_cast<size_t>(epoch & 1)];
  int64_t seen = g.epoch.load(std::memory_order_acquire);
  if (seen != epoch && seen < epoch && g.epoch.compare_exchange_strong(seen, epoch)) {
    for (auto& c : g.counts) c.store(0, std::memory_order_relaxed);
  }
  g.counts[static_cast<size_t>(Bin(seconds))].fetch_add(1, std::memory_order_relaxed);
}

void StepStats::RecordStep(int64_t step, Clock::time_point now, uint64_t busy_ns) {
  MutexLock lock(mu_);
  if (step > 0 && static_cast<uint64_t>(step) > steps_.load(std::memory_order_relaxed)) {
    steps_.store(static_cast<uint64_t>(step), std::memory_order_relaxed);
  }
  ring_[marks_ % kRing] = {now, params_.load(std::memory_order_relaxed), busy_ns};
  ++marks_;
}

StepStats::Snapshot StepStats::Read(Clock::time_point now, uint64_t busy_ns) const {
  Snapshot s;
  s.params_updated = params_.load(std::memory_order_relaxed);
  s.bucket_updates = updates_.load(std::memory_order_relaxed);
  {
    MutexLock lock(mu_);
    s.steps = steps_.load(std::memory_order_relaxed);
    const uint64_t kept = std::min<uint64_t>(marks_, kRing);
    if (kept >= 2) {
      const Mark& oldest = ring_[(marks_ - kept) % kRing];
      const double span = std::chrono::duration<double>(now - oldest.at).count();
      if (span > 0) {
        s.steps_per_s = static_cast<double>(kept - 1) / span;
        s.params_per_s = static_cast<double>(s.params_updated - oldest.params) / span;
        if (busy_ns > oldest.busy_ns) {
          s.busy_s_per_s = static_cast<double>(busy_ns - oldest.busy_ns) * 1e-9 / span;
        }
      }
    }
  }
  // The newest generation and the one before it, when that one is its direct predecessor (an
  // older one holds updates from before a pause).
  const int64_t newest = std::max(generations_[0].epoch.load(std::memory_order_acquire),
                                  generations_[1].epoch.load(std::memory_order_acquire));
  std::array<uint64_t, kBins> counts{};
  for (const Generation& g : generations_) {
    const int64_t epoch = g.epoch.load(std::memory_order_acquire);
    if (epoch < 0 || epoch < newest - 1) continue;
    for (int i = 0; i < kBins; ++i) counts[i] += g.counts[i].load(std::memory_order_relaxed);
  }
  for (uint64_t c : counts) s.latency_samples += c;
  if (s.latency_samples > 0) {
    // The smallest bin whose cumulative count reaches the quantile's rank.
    auto quantile = [&](double q) {
      const auto rank =
          static_cast<uint64_t>(std::ceil(q * static_cast<double>(s.latency_samples)));
      uint64_t seen = 0;
      for (int i = 0; i < kBins; ++i) {
        seen += counts[i];
        if (seen >= std::max<uint64_t>(rank, 1)) return BinSeconds(i);
      }
      return BinSeconds(kBins - 1);
    };
    s.bucket_update_p50_s = quantile(0.50);
    s.bucket_update_p99_s = quantile(0.99);
  }
  return s;
}

}  // namespace tsd
