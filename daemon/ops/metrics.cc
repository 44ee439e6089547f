#include "daemon/ops/metrics.h"

#include <algorithm>
#include <exception>
#include <set>
#include <utility>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/family.h>
#include <prometheus/histogram.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "daemon/ops/version.h"

namespace tsd {
namespace {

constexpr char kJobLabel[] = "job_name";

// From 50 us (a small bucket on one core) to 10 s (a huge bucket on a busy host).
const prometheus::Histogram::BucketBoundaries& BucketUpdateBounds() {
  static const auto* bounds = new prometheus::Histogram::BucketBoundaries{
      5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
      0.05, 0.1,  0.25,   0.5,  1,    2.5,    5,    10};
  return *bounds;
}

prometheus::MetricFamily Gauge(std::string name, std::string help) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = prometheus::MetricType::Gauge;
  return f;
}

void AddSample(prometheus::MetricFamily& f, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  f.metric.push_back(std::move(m));
}

prometheus::MetricFamily Single(std::string name, std::string help, double value) {
  prometheus::MetricFamily f = Gauge(std::move(name), std::move(help));
  AddSample(f, value);
  return f;
}

}  // namespace

// What the exposer scrapes: a view of the Metrics that owns it.
class Metrics::Collector final : public prometheus::Collectable {
 public:
  explicit Collector(const Metrics& metrics) : metrics_(metrics) {}
  std::vector<prometheus::MetricFamily> Collect() const override { return metrics_.Collect(); }

 private:
  const Metrics& metrics_;
};

// What a job's optimizer reports to: the job's series, held for as long as the optimizer lives.
class Metrics::JobObserver final : public OptimizerObserver {
 public:
  // Called under mu_, which a scrape holds while it checks `holders`.
  explicit JobObserver(std::shared_ptr<JobSeries> series) : series_(std::move(series)) {
    series_->holders.fetch_add(1, std::memory_order_relaxed);
  }
  // Everything this observer recorded happens before a scrape that sees `holders` drop.
  ~JobObserver() override { series_->holders.fetch_sub(1, std::memory_order_release); }
  JobObserver(const JobObserver&) = delete;
  JobObserver& operator=(const JobObserver&) = delete;

  void OnBucketUpdate(double seconds, uint64_t params) override {
    series_->bucket_seconds->Observe(seconds);
    series_->params->Increment(static_cast<double>(params));
  }
  void OnStep(int64_t /*step*/) override { series_->steps->Increment(); }

 private:
  const std::shared_ptr<JobSeries> series_;
};

Metrics::Metrics(bool per_job)
    : per_job_(per_job), optimizer_(std::make_shared<prometheus::Registry>()) {
  steps_ = &prometheus::BuildCounter()
                .Name("tsd_optimizer_steps_total")
                .Help("Optimizer steps completed, per job")
                .Register(*optimizer_);
  params_ = &prometheus::BuildCounter()
                 .Name("tsd_optimizer_params_total")
                 .Help("Parameters updated by the optimizer, per job; its rate is the throughput")
                 .Register(*optimizer_);
  bucket_seconds_ = &prometheus::BuildHistogram()
                         .Name("tsd_bucket_update_seconds")
                         .Help("Time to update one bucket of parameters, per job")
                         .Register(*optimizer_);
  collector_ = std::make_shared<Collector>(*this);
}

Metrics::Metrics(const Registry& registry, bool per_job) : Metrics(per_job) {
  WatchRegistry(registry);
}

Metrics::~Metrics() { StopServing(); }

void Metrics::WatchRegistry(const Registry& registry) {
  MutexLock lock(mu_);
  registry_ = &registry;
}

void Metrics::StopServing() {
  exposer_.reset();  // before the collector and the families go away
}

absl::Status Metrics::Listen(const std::string& address) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics at ", address, " (", e.what(),
        "): is the port taken, or not an IP address of this host? Set metrics_listen "
        "(--metrics-listen) to a free HOST:PORT, or to \"\" to turn the endpoint off"));
  }
  exposer_->RegisterCollectable(collector_);
  return absl::OkStatus();
}

int Metrics::port() const {
  if (exposer_ == nullptr) return 0;
  const std::vector<int> ports = exposer_->GetListeningPorts();
  return ports.empty() ? 0 : ports.front();
}

std::shared_ptr<OptimizerObserver> Metrics::ObserverFor(const std::string& job) {
  MutexLock lock(mu_);
  // Without per-job series every job records into one unlabelled series (key "", never pruned).
  std::shared_ptr<JobSeries>& series = jobs_[per_job_ ? job : std::string()];
  if (series == nullptr) {
    auto s = std::make_shared<JobSeries>();
    const prometheus::Labels labels =
        per_job_ ? prometheus::Labels{{kJobLabel, job}} : prometheus::Labels{};
    s->steps = &steps_->Add(labels);
    s->params = &params_->Add(labels);
    s->bucket_seconds = &bucket_seconds_->Add(labels, BucketUpdateBounds());
    s->generation = generation_;
    series = std::move(s);
  }
  return std::make_shared<JobObserver>(series);
}

std::vector<prometheus::MetricFamily> Metrics::Collect() const {
  uint64_t generation;
  const Registry* registry;
  std::function<std::vector<NamedGauge>()> gauges;
  {
    MutexLock lock(mu_);
    generation = ++generation_;  // series created from here on survive this scrape
    registry = registry_;
    gauges = gauges_;
  }

  std::vector<prometheus::MetricFamily> out;
  {
    prometheus::MetricFamily f = Gauge("tsd_build_info", "The daemon's version (always 1)");
    AddSample(f, 1, {{"version", kVersion}});
    out.push_back(std::move(f));
  }
  out.push_back(Single("tsd_start_time_seconds", "When the daemon started, in Unix time",
                       absl::ToDoubleSeconds(started_ - absl::UnixEpoch())));
  if (registry == nullptr) {
    for (auto& f : optimizer_->Collect()) out.push_back(std::move(f));
    return out;
  }
  const Registry::MetricsView view = registry->View();
  out.push_back(Single("tsd_pool_bytes", "The pool's capacity in bytes",
                       static_cast<double>(view.pool.pool_bytes)));
  out.push_back(Single("tsd_pool_used_bytes", "Bytes of the pool held by jobs",
                       static_cast<double>(view.pool.used_bytes)));
  out.push_back(Single("tsd_pool_locked_bytes", "Bytes of the pool's regions that are mlock()ed",
                       static_cast<double>(view.locked_bytes)));
  out.push_back(Single("tsd_max_job_quota_bytes", "The largest quota a new job may get, in bytes",
                       static_cast<double>(view.max_job_quota_bytes)));
  out.push_back(Single("tsd_jobs", "Jobs holding memory", view.pool.jobs));
  out.push_back(Single("tsd_sessions", "Live sessions (hello completed)", view.pool.sessions));
  if (gauges) {
    for (const NamedGauge& g : gauges()) out.push_back(Single(g.name, g.help, g.value));
  }

  prometheus::MetricFamily info = Gauge("tsd_job_info", "One per job, labelled with its owner uid");
  prometheus::MetricFamily used = Gauge("tsd_job_used_bytes", "Bytes a job holds");
  prometheus::MetricFamily quota = Gauge("tsd_job_quota_bytes", "A job's quota in bytes");
  prometheus::MetricFamily sessions = Gauge("tsd_job_sessions", "A job's live sessions");
  prometheus::MetricFamily regions = Gauge("tsd_job_regions", "A job's regions");
  // What the jobs' clients report of their last step (JobActivity), per job or in aggregate.
  prometheus::MetricFamily optimizer_info = Gauge(
      "tsd_job_optimizer_info", "One per job with an optimizer, labelled with its moment dtype");
  prometheus::MetricFamily wait = Gauge(
      "tsd_job_step_wait_seconds", "How long a job's last step() waited for tsd (client-reported)");
  prometheus::MetricFamily paging = Gauge(
      "tsd_job_paging_bytes_per_step", "A job's paging traffic in its last step (client-reported)");
  double max_wait = 0, all_h2d = 0, all_d2h = 0;
  std::set<std::string> live = {""};  // the aggregate series stays
  double all_regions = 0;
  for (const v1::JobInfo& j : view.jobs) all_regions += j.regions();
  out.push_back(Single("tsd_regions", "Regions held by all jobs", all_regions));
  for (const v1::JobInfo& j : view.jobs) {
    live.insert(j.name());
    if (!per_job_) continue;
    const std::vector<prometheus::ClientMetric::Label> label = {{kJobLabel, j.name()}};
    AddSample(info, 1, {{kJobLabel, j.name()}, {"uid", std::to_string(j.uid())}});
    AddSample(used, static_cast<double>(j.used_bytes()), label);
    AddSample(quota, static_cast<double>(j.quota_bytes()), label);
    AddSample(sessions, j.sessions(), label);
    AddSample(regions, j.regions(), label);
  }
  for (const v1::JobInfo& j : view.jobs) {
    if (!j.has_activity()) continue;
    const v1::JobActivity& a = j.activity();
    max_wait = std::max(max_wait, a.client_step_wait_s());
    all_h2d += static_cast<double>(a.client_h2d_bytes());
    all_d2h += static_cast<double>(a.client_d2h_bytes());
    if (!per_job_) continue;
    AddSample(optimizer_info, 1,
              {{kJobLabel, j.name()}, {"moment_dtype", v1::DType_Name(a.moment_dtype())}});
    if (a.client_reports() == 0) continue;
    AddSample(wait, a.client_step_wait_s(), {{kJobLabel, j.name()}});
    AddSample(paging, static_cast<double>(a.client_h2d_bytes()),
              {{kJobLabel, j.name()}, {"direction", "h2d"}});
    AddSample(paging, static_cast<double>(a.client_d2h_bytes()),
              {{kJobLabel, j.name()}, {"direction", "d2h"}});
  }
  if (per_job_) {
    for (auto* f : {&info, &used, &quota, &sessions, &regions, &optimizer_info, &wait, &paging})
      out.push_back(std::move(*f));
  } else {
    out.push_back(Single("tsd_step_wait_seconds_max",
                         "The longest last-step wait in step() among the jobs (client-reported)",
                         max_wait));
    prometheus::MetricFamily all =
        Gauge("tsd_paging_bytes_per_step",
              "The jobs' paging traffic in their last step (client-reported)");
    AddSample(all, all_h2d, {{"direction", "h2d"}});
    AddSample(all, all_d2h, {{"direction", "d2h"}});
    out.push_back(std::move(all));
  }

  {
    MutexLock lock(mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      // A series gains holders only under mu_, so one seen without any stays so while we hold it.
      const JobSeries& s = *it->second;
      if (s.generation < generation && live.count(it->first) == 0 &&
          s.holders.load(std::memory_order_acquire) == 0) {
        steps_->Remove(s.steps);
        params_->Remove(s.params);
        bucket_seconds_->Remove(s.bucket_seconds);
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& f : optimizer_->Collect()) out.push_back(std::move(f));
  return out;
}

void Metrics::WatchGauges(std::function<std::vector<NamedGauge>()> source) {
  MutexLock lock(mu_);
  gauges_ = std::move(source);
}

std::string Metrics::Render() const { return prometheus::TextSerializer().Serialize(Collect()); }

}  // namespace tsd
