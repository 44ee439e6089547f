// OptimizerObserver is what a job's optimizer engine reports to: each bucket update (its latency
// and how many parameters it updated) and each optimizer step the job completes. It is the
// engine's only outward edge, so daemon/optimizer depends on nothing above it: the daemon's
// metrics (daemon/ops/metrics) implement it, a test can count calls.
//
// An observer is resolved once per job optimizer (OptimizerObservers::ObserverFor, when the
// optimizer is created), so the hot path makes a virtual call and no lookup. Its methods are
// called from the engine's dispatcher and worker threads, concurrently: implementations must be
// thread-safe and cheap (a counter add, a histogram observation).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace tsd {

class OptimizerObserver {
 public:
  virtual ~OptimizerObserver() = default;
  // One bucket update took `seconds` (from its gradients being ready to its parameters written)
  // and updated `params` parameters.
  virtual void OnBucketUpdate(double seconds, uint64_t params) = 0;
  // The job completed optimizer step `step` (the first time any of its buckets reached it).
  virtual void OnStep(int64_t step) = 0;
};

// Hands out the observer of a job; what the Registry is given (RegistryOptions::metrics).
class OptimizerObservers {
 public:
  virtual ~OptimizerObservers() = default;
  // The observer for `job`'s optimizer (never null). It stays valid for as long as it is held,
  // whatever happens to the job.
  virtual std::shared_ptr<OptimizerObserver> ObserverFor(const std::string& job) = 0;
};

}  // namespace tsd
