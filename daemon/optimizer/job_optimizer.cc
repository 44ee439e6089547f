#include "daemon/optimizer/job_optimizer.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "daemon/optimizer/chunks.h"
#include "proto/futex.h"
#include "proto/status_macros.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

constexpr size_t kMaxGroups = 1024;
constexpr size_t kMaxBuckets = 65536;
constexpr uint32_t kMaxWorld = 4096;     // data-parallel ranks sharing one optimizer
constexpr int64_t kSpinNs = 30000;       // the dispatcher spins this long before sleeping
constexpr int64_t kSleepNs = 100000000;  // and sleeps at most this long (to notice Stop)

uint64_t Align64(uint64_t x) { return (x + 63) / 64 * 64; }

absl::StatusOr<kernels::DType> ToKernel(v1::DType d, const char* what, bool allow_unspecified) {
  switch (d) {
    case v1::F32:
      return kernels::DType::kF32;
    case v1::BF16:
      return kernels::DType::kBF16;
    case v1::F16:
      return kernels::DType::kF16;
    case v1::DTYPE_UNSPECIFIED:
      if (allow_unspecified) return kernels::DType::kF32;
      [[fallthrough]];
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(what, " must be F32, BF16 or F16 (got ", static_cast<int>(d), ")"));
  }
}

// The hyperparameter checks torch.optim.AdamW makes, plus finiteness.
absl::Status CheckHyper(double lr, double beta1, double beta2, double eps, double wd) {
  if (!std::isfinite(lr) || lr < 0)
    return absl::InvalidArgumentError(absl::StrCat("invalid learning rate ", lr));
  if (!(beta1 >= 0 && beta1 < 1))
    return absl::InvalidArgumentError(
        absl::StrCat("invalid beta1 ", beta1, " (must be in [0, 1))"));
  if (!(beta2 >= 0 && beta2 < 1))
    return absl::InvalidArgumentError(
        absl::StrCat("invalid beta2 ", beta2, " (must be in [0, 1))"));
  if (!std::isfinite(eps) || eps < 0)
    return absl::InvalidArgumentError(absl::StrCat("invalid eps ", eps));
  if (!std::isfinite(wd) || wd < 0)
    return absl::InvalidArgumentError(absl::StrCat("invalid weight_decay ", wd));
  return absl::OkStatus();
}

// CLOCK_MONOTONIC in nanoseconds: the clock the control page's timestamps use (the client's
// time.monotonic_ns() and steady_clock read it too).
uint64_t MonotonicNs() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<uint64_t>(t.tv_sec) * 1000000000u + static_cast<uint64_t>(t.tv_nsec);
}

}  // namespace

absl::StatusOr<OptimizerPlan> JobOptimizer::Plan(const v1::RegisterOptimizerRequest& req,
                                                 uint64_t max_bytes) {
  OptimizerPlan p;
  if (req.groups_size() < 1 || static_cast<size_t>(req.groups_size()) > kMaxGroups) {
    return absl::InvalidArgumentError(absl::StrCat(
        "an optimizer needs 1 to ", kMaxGroups, " parameter groups (got ", req.groups_size(), ")"));
  }
  if (req.buckets_size() < 1 || static_cast<size_t>(req.buckets_size()) > kMaxBuckets) {
    return absl::InvalidArgumentError(absl::StrCat("an optimizer needs 1 to ", kMaxBuckets,
                                                   " buckets (got ", req.buckets_size(), ")"));
  }
  for (int g = 0; g < req.groups_size(); ++g) {
    const auto& grp = req.groups(g);
    if (grp.amsgrad()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", g,
                       ": amsgrad=True is not supported by tsd's AdamW; "
                       "use amsgrad=False (torch's default)"));
    }
    if (grp.maximize()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group ", g,
                       ": maximize=True is not supported by tsd's AdamW; "
                       "negate the loss instead"));
    }
    if (absl::Status s =
            CheckHyper(grp.lr(), grp.beta1(), grp.beta2(), grp.eps(), grp.weight_decay());
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("group ", g, ": ", s.message()));
    }
    p.groups.push_back(grp);
  }
  TSD_ASSIGN_OR_RETURN(const kernels::DType moment,
                       ToKernel(req.moment_dtype(), "moment_dtype", true));
  if (moment == kernels::DType::kF16) {
    return absl::InvalidArgumentError(
        "moment_dtype must be F32 or BF16 (F16 moments are not supported)");
  }
  p.moment_dtype = moment;
  if (!std::isfinite(req.max_grad_norm()) || req.max_grad_norm() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_grad_norm must be >= 0 (got ", req.max_grad_norm(), ")"));
  }
  p.max_grad_norm = req.max_grad_norm();
  p.accumulate = req.accumulate();
  p.seed = req.seed();
  if (req.world() > kMaxWorld) {
    return absl::InvalidArgumentError(absl::StrCat("world must be at most ", kMaxWorld,
                                                   " data-parallel ranks (got ", req.world(), ")"));
  }
  if (req.rank() >= std::max<uint32_t>(req.world(), 1)) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(),
                                                   " is out of range for a world of ", req.world(),
                                                   " (ranks are 0 to world - 1)"));
  }
  p.world = req.world() > 1 ? req.world() : 0;
  p.rank = req.rank();
  // Data parallel commits need every rank's norm first; speculation is one process's.
  p.speculate_clip = p.max_grad_norm > 0 && p.world == 0 && !req.hold_clipped_updates();
  const uint64_t msize = kernels::DTypeSize(p.moment_dtype);
  uint64_t master = 0, moments = 0, grads = 0, params = 0;
  const uint64_t max_numel = max_bytes / 4;
  uint64_t total_numel = 0;
  for (int b = 0; b < req.buckets_size(); ++b) {
    const auto& spec = req.buckets(b);
    if (spec.group() >= static_cast<uint32_t>(req.groups_size())) {
      return absl::InvalidArgumentError(absl::StrCat("bucket ", b, " names group ", spec.group(),
                                                     " but there are ", req.groups_size(),
                                                     " groups"));
    }
    if (spec.numel() > max_numel || total_numel + spec.numel() > max_numel) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "bucket ", b, ": ", total_numel + spec.numel(), " parameters cannot fit in the pool"));
    }
    total_numel += spec.numel();
    auto gd = ToKernel(spec.grad_dtype(), "grad_dtype", false);
    if (!gd.ok())
      return absl::InvalidArgumentError(absl::StrCat("bucket ", b, ": ", gd.status().message()));
    auto pd = ToKernel(spec.param_dtype(), "param_dtype", false);
    if (!pd.ok())
      return absl::InvalidArgumentError(absl::StrCat("bucket ", b, ": ", pd.status().message()));
    BucketPlan bp;
    bp.group = spec.group();
    bp.numel = static_cast<int64_t>(spec.numel());
    bp.grad_dtype = *gd;
    bp.param_dtype = *pd;
    bp.master_offset = master;
    bp.moment_offset = moments;
    bp.grad_offset = grads;
    bp.param_offset = params;
    master += Align64(spec.numel() * 4);
    moments += Align64(spec.numel() * msize);
    grads += Align64(spec.numel() * kernels::DTypeSize(*gd));
    params += Align64(spec.numel() * kernels::DTypeSize(*pd));
    p.buckets.push_back(bp);
  }
  auto page = [](uint64_t x) {
    return std::max<uint64_t>(wire::kPageBytes,
                              (x + wire::kPageBytes - 1) / wire::kPageBytes * wire::kPageBytes);
  };
  p.control_bytes =
      page(wire::ControlPageBytes(static_cast<uint32_t>(req.groups_size()),
                                  static_cast<uint32_t>(req.buckets_size()), p.world));
  p.master_bytes = page(master);
  p.moment_bytes = page(moments);
  p.grad_bytes = page(grads);
  // fp32 parameters are the masters bit for bit: their slots need no memory of their own, and
  // an update need not write them twice (4 bytes per parameter less in the pool and in traffic).
  // Only for a client that maps the slots there (RegisterOptimizerRequest.params_in_master_ok).
  p.params_in_master = req.params_in_master_ok() && !p.buckets.empty() &&
                       std::all_of(p.buckets.begin(), p.buckets.end(), [](const BucketPlan& b) {
                         return b.param_dtype == kernels::DType::kF32;
                       });
  if (p.params_in_master) {
    for (BucketPlan& b : p.buckets) b.param_offset = b.master_offset;
  }
  p.param_bytes = p.params_in_master ? 0 : page(params);
  p.accum_bytes = p.accumulate ? page(master) : 0;
  return p;
}

JobOptimizer::JobOptimizer(std::string job, OptimizerPlan plan, OptimizerRegions regions,
                           WorkerPool& pool, kernels::Isa isa,
                           std::shared_ptr<OptimizerObserver> observer)
    : job_(std::move(job)),
      plan_(std::move(plan)),
      regions_(std::move(regions)),
      pool_(pool),
      queue_(pool.NewQueue(plan_.numa_node)),
      isa_(isa),
      observer_(std::move(observer)) {
  page_ =
      wire::ControlView::Of(regions_.control->data(), static_cast<uint32_t>(plan_.groups.size()),
                            static_cast<uint32_t>(plan_.buckets.size()));
  page_.header->magic = wire::kControlPageMagic;
  page_.header->version = wire::kControlPageVersion;
  page_.header->num_groups = static_cast<uint32_t>(plan_.groups.size());
  page_.header->num_buckets = static_cast<uint32_t>(plan_.buckets.size());
  page_.header->world = plan_.world;
  for (size_t g = 0; g < plan_.groups.size(); ++g) {
    const auto& grp = plan_.groups[g];
    page_.groups[g] = {grp.lr(), grp.beta1(), grp.beta2(), grp.eps(), grp.weight_decay()};
  }
  auto base = [](const std::shared_ptr<Region>& r) {
    return r ? static_cast<char*>(r->data()) : nullptr;
  };
  for (size_t b = 0; b < plan_.buckets.size(); ++b) {
    auto run = std::make_unique<BucketRun>();
    run->plan = plan_.buckets[b];
    run->master = reinterpret_cast<float*>(base(regions_.master) + run->plan.master_offset);
    run->exp_avg = base(regions_.exp_avg) + run->plan.moment_offset;
    run->exp_avg_sq = base(regions_.exp_avg_sq) + run->plan.moment_offset;
    run->grad = base(regions_.grads) + run->plan.grad_offset;
    // With params_in_master the update writes no parameter copy (the slot is the master).
    run->param = plan_.params_in_master ? nullptr : base(regions_.params) + run->plan.param_offset;
    if (regions_.accum)
      run->accum = reinterpret_cast<float*>(base(regions_.accum) + run->plan.master_offset);
    run->sr_seed = plan_.seed ^ (0x9E3779B97F4A7C15ull * (b + 1));
    runs_.push_back(std::move(run));
  }
}

JobOptimizer::~JobOptimizer() { Stop(); }

void JobOptimizer::Start() {
  MutexLock lock(lifecycle_mu_);
  dispatcher_ = std::thread([this] { DispatchLoop(); });
}

void JobOptimizer::Stop() {
  MutexLock lock(lifecycle_mu_);
  stop_.store(true);
  Kick();
  if (dispatcher_.joinable()) dispatcher_.join();
  pool_.Cancel(queue_);
}

std::string JobOptimizer::failure() const {
  MutexLock lock(failure_mu_);
  return failure_;
}

bool JobOptimizer::resumable() const {
  MutexLock lock(failure_mu_);
  return failed_.load() && resumable_;
}

void JobOptimizer::Kick() {
  page_.header->doorbell.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&page_.header->doorbell);
}

void JobOptimizer::Fail(const std::string& why, bool resumable) {
  MutexLock lock(failure_mu_);  // held throughout: resumable() and Revive() see all of it or none
  if (failed_.exchange(true)) return;
  failure_ = why;
  resumable_ = resumable;
  const size_t n = std::min(why.size(), sizeof(page_.header->error) - 1);
  std::memcpy(page_.header->error, why.data(), n);
  page_.header->error[n] = '\0';
  page_.header->failed.store(1, std::memory_order_release);
  page_.header->completions.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&page_.header->completions);
  spdlog::warn("event=optimizer_failed job={} resumable={} reason=\"{}\"", job_, resumable, why);
}

void JobOptimizer::DispatchLoop() {
  pool_.PinCurrentThreadToNode(plan_.numa_node);  // it runs small updates itself
  while (!stop_.load(std::memory_order_acquire) && !failed_.load()) {
    const uint32_t seen = page_.header->doorbell.load(std::memory_order_acquire);
    if (!Scan()) return;
    // Spin a little (a next bucket often follows right away), then sleep on the doorbell.
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(kSpinNs);
    bool rang = false;
    while (std::chrono::steady_clock::now() < spin_until) {
      if (page_.header->doorbell.load(std::memory_order_acquire) != seen) {
        rang = true;
        break;
      }
    }
    if (!rang) wire::FutexWait(&page_.header->doorbell, seen, kSleepNs);
  }
}

bool JobOptimizer::Scan() {
  // SaveState/LoadState (side-socket thread) read the dispatcher's own fields (done_local, held,
  // committed_local_) and must not see a delivery taken half-way: they hold this mutex too.
  MutexLock lock(state_mu_);
  // Read the commit counter first: the client bumps it after marking its deliveries, so every
  // delivery before the commit is visible below.
  uint64_t commit = 0;
  if (!ReadCommit(&commit)) return false;
  if (commit_running_ && commit_left_.load(std::memory_order_acquire) == 0) commit_running_ = false;
  for (size_t b = 0; b < runs_.size(); ++b) {
    BucketRun& run = *runs_[b];
    if (run.busy.load(std::memory_order_acquire)) continue;
    const uint64_t ready = page_.buckets[b].ready.load(std::memory_order_acquire);
    if (ready == run.done_local) continue;
    if (ready != run.done_local + 1) {
      Fail(absl::StrCat("control page: bucket ", b, " ready counter is ", ready, " but ",
                        run.done_local, " deliveries were completed (it may only advance by one)"));
      return false;
    }
    if (run.held) {
      Fail(absl::StrCat("control page: bucket ", b,
                        " got a new delivery before the commit of its last one"));
      return false;
    }
    if (!TakeDelivery(b, ready)) return false;
  }
  if (plan_.max_grad_norm > 0) {
    if (commit_running_) {
      AdvanceCommit();
    } else if (commit > committed_local_) {
      MaybeApplyCommit();
    }
  }
  return !failed_.load();
}

bool JobOptimizer::ReadCommit(uint64_t* commit) {
  // The lambda reads a copy: clang's thread-safety analysis does not carry state_mu_ into it.
  const uint64_t committed = committed_local_;
  const auto check = [this, committed](uint64_t c, const std::string& whose) {
    if (c >= committed && c <= committed + 1) return true;
    Fail(absl::StrCat("control page: ", whose, "commit counter ", c, " is not ", committed, " or ",
                      committed + 1));
    return false;
  };
  if (plan_.world <= 1) {
    *commit = page_.header->commit.load(std::memory_order_acquire);
    return check(*commit, "");
  }
  // Data parallel: a commit is applied once every rank asked for it.
  uint64_t lowest = committed_local_ + 1;
  for (uint32_t r = 0; r < plan_.world; ++r) {
    const uint64_t c = page_.ranks[r].commit.load(std::memory_order_acquire);
    if (!check(c, absl::StrCat("rank ", r, "'s "))) return false;
    lowest = std::min(lowest, c);
  }
  *commit = lowest;
  return true;
}

bool JobOptimizer::TakeDelivery(size_t b, uint64_t ready) {
  BucketRun& run = *runs_[b];
  if (run.retired) {
    Fail(absl::StrCat("control page: bucket ", b,
                      " was retired (its optimizer moved to the trainer's GPU share), but a "
                      "gradient was delivered for it"));
    return false;
  }
  const uint32_t flags = page_.buckets[b].flags.load(std::memory_order_acquire);
  if ((flags & ~wire::kDeliveryKnownFlags) != 0) {
    Fail(absl::StrCat("control page: bucket ", b, " has unknown flag bits 0x", absl::Hex(flags)));
    return false;
  }
  const bool first = flags & wire::kDeliveryFirst, final = flags & wire::kDeliveryFinal;
  const bool direct = first && final;  // one delivery per step: no accumulator needed
  if (!direct && run.accum == nullptr) {
    Fail(absl::StrCat("control page: bucket ", b, " asks for gradient accumulation (flags 0x",
                      absl::Hex(flags),
                      ") but the optimizer was registered without accumulate=true"));
    return false;
  }
  page_.buckets[b].taken_ns.store(MonotonicNs(), std::memory_order_relaxed);
  run.busy.store(true, std::memory_order_relaxed);
  run.pending = ready;
  run.done_local = ready;  // taken: the next valid counter value is ready + 1
  const bool clip = plan_.max_grad_norm > 0;
  const bool spec = clip && final && ShouldSpeculate(b);
  const kernels::DType gd = run.plan.grad_dtype;

  if (direct && !clip) {
    StepBucket(b, run.grad, gd, 1.0f, [this, b] { CompleteDelivery(b); });
    return true;
  }
  if (direct && clip) {
    if (spec) {
      SpeculateBucket(b, /*from_accum=*/false);
    } else {
      HoldForCommit(b, /*from_accum=*/false);
    }
    return true;
  }
  // Accumulate, then (final) step from the accumulator or hold it for the commit.
  RunChunked(
      b,
      [this, run = &run, gd, first](int64_t begin, int64_t n, size_t) {
        kernels::AccumulateGrad(
            static_cast<const char*>(run->grad) + begin * kernels::DTypeSize(gd), gd,
            run->accum + begin, n, first, isa_);
      },
      [this, b, final, clip, spec] {
        BucketRun& r = *runs_[b];
        if (!final) {
          CompleteDelivery(b);
        } else if (!clip) {
          StepBucket(b, r.accum, kernels::DType::kF32, 1.0f, [this, b] { CompleteDelivery(b); });
        } else if (spec) {
          SpeculateBucket(b, /*from_accum=*/true);
        } else {
          HoldForCommit(b, /*from_accum=*/true);
        }
      });
  return true;
}

JobOptimizer::FinalGrad JobOptimizer::FinalGradOf(const BucketRun& run, bool from_accum) {
  if (from_accum) return {run.accum, kernels::DType::kF32};
  return {run.grad, run.plan.grad_dtype};
}

absl::StatusOr<kernels::AdamWHyper> JobOptimizer::PageHyper(uint32_t group) const {
  const wire::ControlGroup g = page_.groups[group];  // a copy: the page is not ours
  if (absl::Status s = CheckHyper(g.lr, g.beta1, g.beta2, g.eps, g.weight_decay); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("control page: group ", group, ": ", s.message()));
  }
  kernels::AdamWHyper h;
  h.lr = g.lr;
  h.beta1 = g.beta1;
  h.beta2 = g.beta2;
  h.eps = g.eps;
  h.weight_decay = g.weight_decay;
  return h;
}

absl::Status JobOptimizer::CheckBucketList(absl::string_view request,
                                           absl::Span<const uint32_t> buckets) const {
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] >= runs_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(request, ": bucket ", buckets[i],
                                                     " does not exist (the optimizer has ",
                                                     runs_.size(), " buckets)"));
    }
    if (i > 0 && buckets[i] <= buckets[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(request,
                                                     ": the buckets must be strictly ascending (",
                                                     buckets[i], " follows ", buckets[i - 1], ")"));
    }
  }
  return absl::OkStatus();
}

std::optional<kernels::AdamWHyper> JobOptimizer::NextStepHyper(BucketRun& run,
                                                               const kernels::AdamWHyper* fixed) {
  absl::StatusOr<kernels::AdamWHyper> h =
      fixed != nullptr ? absl::StatusOr<kernels::AdamWHyper>(*fixed) : PageHyper(run.plan.group);
  if (!h.ok()) {
    Fail(std::string(h.status().message()));
    return std::nullopt;
  }
  h->step = ++run.steps;
  return *h;
}

kernels::AdamWTensors JobOptimizer::Tensors(const BucketRun& run, const void* grad,
                                            kernels::DType grad_dtype, int64_t begin,
                                            int64_t n) const {
  const size_t gsize = kernels::DTypeSize(grad_dtype),
               msize = kernels::DTypeSize(plan_.moment_dtype),
               psize = kernels::DTypeSize(run.plan.param_dtype);
  kernels::AdamWTensors t;
  t.grad = static_cast<const char*>(grad) + begin * gsize;
  t.grad_dtype = grad_dtype;
  t.master = run.master + begin;
  t.exp_avg = static_cast<char*>(run.exp_avg) + begin * msize;
  t.exp_avg_sq = static_cast<char*>(run.exp_avg_sq) + begin * msize;
  t.moment_dtype = plan_.moment_dtype;
  t.param_out = run.param ? static_cast<char*>(run.param) + begin * psize : nullptr;
  t.param_dtype = run.plan.param_dtype;
  t.n = n;
  t.sr_seed = run.sr_seed;
  t.sr_offset = begin;
  return t;
}

void JobOptimizer::StepBucket(size_t b, const void* grad, kernels::DType grad_dtype,
                              float grad_scale, std::function<void()> after,
                              const kernels::AdamWHyper* fixed) {
  BucketRun& run = *runs_[b];
  const std::optional<kernels::AdamWHyper> h = NextStepHyper(run, fixed);
  if (!h) return;
  kernels::AdamWHyper hyper = *h;
  hyper.grad_scale = grad_scale;
  run.started = std::chrono::steady_clock::now();
  RunChunked(
      b,
      [this, run = &run, grad, grad_dtype, hyper](int64_t begin, int64_t n, size_t) {
        kernels::AdamWStep(Tensors(*run, grad, grad_dtype, begin, n), hyper, isa_);
      },
      [this, b, after = std::move(after)] {
        RecordLatency(b);
        PublishStep(b);
        after();
      });
}

void JobOptimizer::RecordLatency(size_t b) {
  const BucketRun& r = *runs_[b];
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - r.started).count();
  stats_.RecordBucket(seconds, static_cast<uint64_t>(r.plan.numel));
  if (observer_ != nullptr) observer_->OnBucketUpdate(seconds, static_cast<uint64_t>(r.plan.numel));
}

void JobOptimizer::PublishStep(size_t b) {
  const BucketRun& r = *runs_[b];
  // Release: a data-parallel rank that does not own the bucket reads its parameter slot once it
  // sees the step count.
  page_.buckets[b].steps.store(static_cast<uint32_t>(r.steps), std::memory_order_release);
  // A job's step count is the highest step any of its buckets reached.
  int64_t seen = max_step_.load(std::memory_order_relaxed);
  while (r.steps > seen && !max_step_.compare_exchange_weak(seen, r.steps)) {
  }
  if (r.steps > seen) {
    stats_.RecordStep(r.steps, StepStats::Clock::now(),
                      work_busy_ns_.load(std::memory_order_relaxed));
    if (observer_ != nullptr) observer_->OnStep(r.steps);
  }
}

void JobOptimizer::RunChunked(size_t b, std::function<void(int64_t, int64_t, size_t)> fn,
                              std::function<void()> done) {
  BucketRun& run = *runs_[b];
  // The page's began/ended stamps: chunk 0 runs first (same priority, submitted first).
  wire::ControlBucket& slot = page_.buckets[b];
  RunChunkedOn(
      run.plan.numel, run.remaining, Priority(b),
      [fn = std::move(fn), &slot](int64_t begin, int64_t n, size_t chunk) {
        if (chunk == 0) slot.began_ns.store(MonotonicNs(), std::memory_order_relaxed);
        fn(begin, n, chunk);
      },
      [done = std::move(done), &slot] {
        slot.ended_ns.store(MonotonicNs(), std::memory_order_relaxed);
        done();
      });
}

void JobOptimizer::RunChunkedOn(int64_t n, std::atomic<int64_t>& remaining, uint64_t priority,
                                std::function<void(int64_t, int64_t, size_t)> fn,
                                std::function<void()> done) {
  if (n <= chunks::kInline) {
    if (n > 0) TimeWork([&] { fn(0, n, 0); });
    done();
    return;
  }
  const int64_t count = static_cast<int64_t>(chunks::Count(n));
  remaining.store(count, std::memory_order_relaxed);
  auto shared_fn = std::make_shared<std::function<void(int64_t, int64_t, size_t)>>(std::move(fn));
  auto shared_done = std::make_shared<std::function<void()>>(std::move(done));
  std::vector<std::function<void()>> tasks;
  tasks.reserve(static_cast<size_t>(count));
  for (int64_t c = 0; c < count; ++c) {
    const int64_t begin = c * chunks::kChunk, len = std::min(chunks::kChunk, n - begin);
    tasks.push_back([this, left = &remaining, shared_fn, shared_done, begin, len, c] {
      TimeWork([&] { (*shared_fn)(begin, len, static_cast<size_t>(c)); });
      if (left->fetch_sub(1, std::memory_order_acq_rel) == 1) (*shared_done)();
    });
  }
  pool_.Submit(queue_, std::move(tasks), priority);
}

uint64_t JobOptimizer::Priority(size_t b) const {
  const uint32_t order = page_.buckets[b].order.load(std::memory_order_relaxed);
  return order != 0 ? order : (uint64_t{1} << 32) + b;  // buckets without an order go last
}

void JobOptimizer::CompleteDelivery(size_t b) {
  BucketRun& run = *runs_[b];
  page_.buckets[b].published_ns.store(MonotonicNs(), std::memory_order_relaxed);
  page_.buckets[b].done.store(run.pending, std::memory_order_release);
  run.busy.store(false, std::memory_order_release);
  page_.header->completions.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&page_.header->completions);
}

bool JobOptimizer::Idle() const {
  for (size_t b = 0; b < runs_.size(); ++b) {
    if (runs_[b]->busy.load(std::memory_order_acquire) || runs_[b]->held) return false;
    if (page_.buckets[b].ready.load(std::memory_order_acquire) != runs_[b]->done_local)
      return false;
  }
  return true;
}

}  // namespace tsd
