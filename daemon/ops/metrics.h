// Metrics is tsd's Prometheus endpoint: `GET http://<metrics_listen>/metrics` in the text format,
// served by prometheus-cpp on its own threads.
//
// Two kinds of figures are exported. The pool and the jobs are not counted here at all: they are
// read from the Registry at each scrape (Registry::View, one lock), so they always agree with
// `tsctl status --json` and `tsctl jobs --json`. The optimizer's figures are events only the
// engine sees, so the engine reports them to the job's observer (ObserverFor, resolved once when
// the job's optimizer is created).
//
// By default only aggregate figures are exported: every local user may scrape the endpoint, and
// job names, owners and usage are not theirs to see. With `metrics_per_job` on, the per-job
// series below are exported too, and the optimizer's series carry the job's name; off, the
// optimizer's series are one aggregate over all jobs, without labels.
//
// Exported (per job, the label is `job_name`: `job` is the label Prometheus itself gives every
// scraped target, and a target's own `job` label would be renamed `exported_job`):
//   tsd_build_info{version}                 1
//   tsd_start_time_seconds                  when the daemon started (Unix time)
//   tsd_pool_bytes                          the pool's capacity
//   tsd_pool_used_bytes                     bytes held by all jobs (allocations in flight included)
//   tsd_pool_locked_bytes                   bytes of regions that are mlock()ed
//   tsd_max_job_quota_bytes                 the largest quota a new job may get
//   tsd_jobs, tsd_sessions, tsd_regions     jobs, live sessions, regions held
//   (with metrics_per_job:)
//   tsd_job_info{job_name,uid}              1 per job (its owner)
//   tsd_job_used_bytes{job_name}            bytes the job holds
//   tsd_job_quota_bytes{job_name}           the job's quota
//   tsd_job_sessions{job_name}, tsd_job_regions{job_name}
//   tsd_optimizer_steps_total{job_name}     optimizer steps completed (OnStep)
//   tsd_optimizer_params_total{job_name}    parameters updated; its rate() is the throughput
//   tsd_bucket_update_seconds{job_name}     histogram: time to update one bucket
//   tsd_job_optimizer_info{job_name,moment_dtype}  1 per job with an optimizer
//   tsd_job_step_wait_seconds{job_name}     its last step()'s wait for tsd (client-reported)
//   tsd_job_paging_bytes_per_step{job_name,direction="h2d"|"d2h"}  its last step's paging
//   (without metrics_per_job, in their place:)
//   tsd_step_wait_seconds_max               the longest of the jobs' last-step waits
//   tsd_paging_bytes_per_step{direction}    the jobs' last-step paging, summed
// A job's optimizer series disappear with the job (at the first scrape after it is released and
// no observer of it is held any more).
// Weight stores, in aggregate (WatchGauges; daemon/stores): tsd_stores, tsd_store_bytes,
// tsd_store_users, tsd_store_budget_bytes, tsd_store_evictions (since start).
//
// Thread safety: every method may be called from any thread. ObserverFor takes the mutex once per
// optimizer; the observer's calls take none of Metrics' locks (prometheus-cpp's counters are
// atomic, its histograms lock per series), so the engine calls them per bucket.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/optimizer/observer.h"
#include "proto/mutex.h"

namespace prometheus {
class Counter;
class Exposer;
class Histogram;
class Registry;
struct MetricFamily;
template <typename T>
class Family;
}  // namespace prometheus

namespace tsd {

class Registry;

class Metrics final : public OptimizerObservers {
 public:
  // Nothing listens until Listen, and pool and job figures come once a registry is watched. The
  // two steps let the daemon make Metrics before the Registry (whose optimizers record into it).
  // `per_job`: export per-job series (job names, owners, usage), else aggregates only.
  explicit Metrics(bool per_job = false);
  // The same, watching `registry` at once.
  explicit Metrics(const Registry& registry, bool per_job = false);
  ~Metrics() override;
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics at `address`: "127.0.0.1:9464", "0.0.0.0:9464", "[::1]:9464" (an IP address,
  // not a host name). An error says why (e.g. the port is taken) and what to do.
  absl::Status Listen(const std::string& address);
  // Reads pool and job figures from `registry` at each scrape from now on. The registry must
  // outlive the endpoint: call StopServing before destroying it.
  void WatchRegistry(const Registry& registry);
  // Plain gauges read at each scrape from `source` (the stores' aggregate figures), after the
  // pool's. The source must outlive the endpoint.
  struct NamedGauge {
    std::string name, help;
    double value = 0;
  };
  void WatchGauges(std::function<std::vector<NamedGauge>()> source);
  // The port it listens on; 0 when not listening.
  int port() const;
  // Stops serving (waits up to ~2 s for the HTTP threads: run it beside other shutdown work).
  // Idempotent; the destructor does it too.
  void StopServing();

  // The optimizer engine's observer for `job`: its series, created on first use. They outlive
  // the job for as long as the observer is held; the Metrics must outlive its observers.
  std::shared_ptr<OptimizerObserver> ObserverFor(const std::string& job) override;

  // Everything, in the Prometheus text format: what a scrape returns (tests, debugging).
  std::string Render() const;

 private:
  class Collector;
  class JobObserver;
  // One job's series. The families own the metrics; a scrape removes them only when no observer
  // holds them (`holders` is 0), so an observer never points at a removed metric.
  struct JobSeries {
    prometheus::Counter* steps = nullptr;
    prometheus::Counter* params = nullptr;
    prometheus::Histogram* bucket_seconds = nullptr;
    uint64_t generation = 0;  // the scrape generation it was created in
    // Observers alive: raised under mu_ (ObserverFor), lowered (release) by an observer's end.
    std::atomic<int> holders{0};
  };

  // What a scrape returns: the registry's figures, then the optimizer's (after dropping the
  // series of jobs that are gone).
  std::vector<prometheus::MetricFamily> Collect() const;

  const absl::Time started_ = absl::Now();
  const bool per_job_;
  std::shared_ptr<prometheus::Registry> optimizer_;  // owns the families below
  prometheus::Family<prometheus::Counter>* steps_ = nullptr;
  prometheus::Family<prometheus::Counter>* params_ = nullptr;
  prometheus::Family<prometheus::Histogram>* bucket_seconds_ = nullptr;
  std::shared_ptr<Collector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;

  // A scrape prunes the series of released jobs, hence mutable.
  mutable Mutex mu_;
  const Registry* registry_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::function<std::vector<NamedGauge>()> gauges_ ABSL_GUARDED_BY(mu_);
  mutable uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  mutable std::map<std::string, std::shared_ptr<JobSeries>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tsd
