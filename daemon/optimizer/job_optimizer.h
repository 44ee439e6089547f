// JobOptimizer is one job's AdamW engine: fp32 master weights, moments, gradient and parameter
// slots in the job's regions, a dispatcher thread that watches the job's control page, and work
// handed to the shared WorkerPool bucket chunk by bucket chunk.
//
// The dispatcher sleeps on the page's doorbell futex. When the client marks a bucket's delivery
// ready it checks the counters (the page is written by an untrusted process), then accumulates,
// or steps, or (with clipping) computes the bucket's sum of squares and holds it until the
// client's commit. With clipping it may instead speculate: update right away as if clipping will
// not bite (the last step's norm was well under the limit), sum the squares in the same pass,
// and publish the update only at the commit, undoing and redoing it there when clipping did bite
// or the step's hyperparameters changed (docs/daemon.md, "Clipping without a stall"). The commit
// needs only the norm, not the updates: it sums the squares of gradients still being speculated
// on itself, then publishes each bucket as its own update ends (job_optimizer_commit.cc). Small
// buckets run on the dispatcher itself (one thread hop less on the hot path); large ones are split
// into chunks across the pool. Completion stores the bucket's `done` counter and wakes the client.
// Queued updates (and those of a commit) run in the order the client's forward uses the buckets
// (the page's `order`), so the next forward waits least.
//
// Anything invalid on the page fails the optimizer: it stops, writes why into the page, logs it,
// and the Registry closes the session (Registry::Sweep). Destruction stops the dispatcher and
// waits for work in flight, so the regions can be released right after.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/memory/region.h"
#include "daemon/optimizer/observer.h"
#include "daemon/optimizer/step_stats.h"
#include "daemon/optimizer/worker_pool.h"
#include "kernels/cpu/adamw.h"
#include "proto/control_page.h"
#include "proto/mutex.h"
#include "proto/tsd.pb.h"

namespace tsd {

// Where one bucket's data lives (byte offsets into the optimizer's regions).
struct BucketPlan {
  uint32_t group = 0;
  int64_t numel = 0;
  kernels::DType grad_dtype = kernels::DType::kF32;
  kernels::DType param_dtype = kernels::DType::kF32;
  uint64_t master_offset = 0;  // also indexes "opt/accum" (both fp32)
  uint64_t moment_offset = 0;  // into "opt/exp_avg" and "opt/exp_avg_sq"
  uint64_t grad_offset = 0;
  uint64_t param_offset = 0;
};

// The sizes and layout an optimizer registration needs; computed before anything is allocated.
struct OptimizerPlan {
  std::vector<BucketPlan> buckets;
  std::vector<v1::ParamGroup> groups;
  kernels::DType moment_dtype = kernels::DType::kF32;
  double max_grad_norm = 0;
  bool accumulate = false;
  uint64_t seed = 0;
  // Data parallel: the ranks sharing the optimizer (0: one process) and the registering one's.
  uint32_t world = 0;
  uint32_t rank = 0;
  // The NUMA node of the job's GPU (-1: none): its updates run on that node's workers.
  int numa_node = -1;
  uint64_t control_bytes = 0, master_bytes = 0, moment_bytes = 0, grad_bytes = 0, param_bytes = 0,
           accum_bytes = 0;
  // Clipping may speculate (RegisterOptimizerRequest.hold_clipped_updates is false): one process
  // (world 0) with max_grad_norm > 0.
  bool speculate_clip = false;
  // Every bucket's parameters are fp32: their slots are the masters themselves (param_offset ==
  // master_offset, param_bytes 0, no "opt/params" region), and an update writes no copy.
  bool params_in_master = false;
  uint64_t total_bytes() const {
    return control_bytes + master_bytes + 2 * moment_bytes + grad_bytes + param_bytes + accum_bytes;
  }
};

// The regions an optimizer lives in (accum may be null).
struct OptimizerRegions {
  std::shared_ptr<Region> control, master, exp_avg, exp_avg_sq, grads, params, accum;
};

class JobOptimizer final {
 public:
  // Checks a registration request (counts, dtypes, hyperparameters, unsupported options) and
  // lays it out. Nothing is allocated.
  static absl::StatusOr<OptimizerPlan> Plan(const v1::RegisterOptimizerRequest& request,
                                            uint64_t max_bytes);

  // `observer` (may be null) receives each bucket update's latency and each step.
  JobOptimizer(std::string job, OptimizerPlan plan, OptimizerRegions regions, WorkerPool& pool,
               kernels::Isa isa, std::shared_ptr<OptimizerObserver> observer = nullptr);
  ~JobOptimizer();
  JobOptimizer(const JobOptimizer&) = delete;
  JobOptimizer& operator=(const JobOptimizer&) = delete;

  // Starts the dispatcher thread.
  void Start();
  // Stops the dispatcher and waits for work in flight. Idempotent.
  void Stop();
  // Fails the optimizer from outside: every rank's next wait reports `why`. Idempotent: the
  // first failure is kept. `resumable`: the failure leaves the state whole (a data-parallel
  // rank's session died, nothing was wrong on the page), so a restarted group may Revive() it.
  void Abort(const std::string& why, bool resumable = false) { Fail(why, resumable); }
  // True once the optimizer stopped (the page was found invalid, or Abort); `failure()` says why.
  bool failed() const { return failed_.load(); }
  // True when it stopped through Abort(..., resumable=true) (and nothing else failed it first).
  bool resumable() const ABSL_LOCKS_EXCLUDED(failure_mu_);
  std::string failure() const ABSL_LOCKS_EXCLUDED(failure_mu_);
  // Restarts an optimizer stopped by a resumable Abort: clears the failure (the page's too) and
  // starts the dispatcher again; then Resume() settles what was left in flight. OK when it has
  // not failed; FAILED_PRECONDITION when it failed for good.
  absl::Status Revive() ABSL_LOCKS_EXCLUDED(failure_mu_, lifecycle_mu_);
  const OptimizerPlan& plan() const { return plan_; }

  // Writes the state as safetensors into `fd` (a regular file or memfd); returns bytes written.
  // `buckets`: only these (strictly ascending indices; empty: all). A partial file says so in its
  // metadata and LoadState refuses it: the client reads the buckets it needs (a GPU share taking
  // some of them) without writing the whole state.
  absl::StatusOr<uint64_t> SaveState(int fd, absl::Span<const uint32_t> buckets = {})
      ABSL_LOCKS_EXCLUDED(state_mu_);
  // Reads state written by SaveState; validates everything before changing anything.
  absl::StatusOr<uint64_t> LoadState(int fd) ABSL_LOCKS_EXCLUDED(state_mu_);

  // --- Resuming a kept job (job_optimizer_resume.cc) ---
  // Where the optimizer stands once Resume() settled what a dead trainer left in flight.
  struct ResumePoint {
    std::vector<uint64_t> bucket_steps;     // steps applied to each bucket
    uint64_t committed = 0;                 // commits applied
    std::vector<uint32_t> rolled_back;      // held final deliveries dropped (clipping, no commit)
    std::vector<uint32_t> dropped_partial;  // half-accumulated gradients dropped
  };
  // Lets every delivery already rung (and a commit already asked) finish, then drops final
  // deliveries held for a commit that will never come and forgets partial accumulations, so a
  // new trainer starts at a step boundary. DEADLINE_EXCEEDED when work does not finish within
  // `timeout`; FAILED_PRECONDITION when the optimizer has failed.
  absl::StatusOr<ResumePoint> Resume(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(state_mu_);
  // OK when a registration planned as `asked` may take over an optimizer planned as `kept`;
  // else FAILED_PRECONDITION naming the first difference (hyperparameters may differ). `join`:
  // the words for a data-parallel rank joining a live optimizer rather than a resume.
  static absl::Status CheckSameLayout(const OptimizerPlan& kept, const OptimizerPlan& asked,
                                      bool join = false);
  // --- The trainer's GPU share (job_optimizer_retire.cc) ---
  // What RetireBuckets released in one region: the region's name (its ledger label) and the
  // bytes newly returned to the kernel.
  struct Released {
    std::string region;
    uint64_t bytes = 0;
  };
  // Retires buckets whose optimizer moved to the trainer (the GPU share): a delivery for one
  // fails the optimizer from now on, SaveState leaves them out (a full save is then a partial
  // file) and LoadState checks their entries but loads nothing into them, and the whole pages of
  // their moments and accumulator (memory only the daemon maps) go back to the kernel; their
  // masters too with `masters_unpinned` (the trainer no longer pins the master region), unless
  // the masters are the parameter slots (params_in_master). The gradient and parameter slots
  // stay (the trainer maps and pins them). `buckets`: strictly ascending, existing indices, each
  // idle (nothing in flight or held); already retired ones are skipped. FAILED_PRECONDITION under
  // data parallel or after a failure; nothing changes when anything is refused.
  absl::StatusOr<std::vector<Released>> RetireBuckets(absl::Span<const uint32_t> buckets,
                                                      bool masters_unpinned = false)
      ABSL_LOCKS_EXCLUDED(state_mu_);
  // How many buckets are retired.
  size_t retired() const { return retired_count_.load(std::memory_order_acquire); }

  // What the optimizer is doing: its StepStats and the client's report on the control page
  // (job_activity.cc). Any thread.
  void DescribeActivity(v1::JobActivity& out) const;

 private:
  // The dispatcher's view of one bucket (workers touch only the atomics, `partial` and `held`,
  // `sumsq` before releasing `busy`). `done_local` and `held` are read by SaveState/LoadState
  // under state_mu_, which the dispatcher holds while it changes them (Scan); an annotation
  // cannot name the optimizer's mutex from here, so the methods are annotated instead.
  struct BucketRun {
    BucketPlan plan;
    float* master = nullptr;
    void* exp_avg = nullptr;
    void* exp_avg_sq = nullptr;
    void* grad = nullptr;
    void* param = nullptr;
    float* accum = nullptr;
    uint64_t done_local = 0;  // dispatcher: last delivery completed or taken
    std::atomic<bool> busy{false};
    uint64_t pending = 0;  // the delivery in flight
    bool held = false;     // a final delivery waits for the commit
    bool held_from_accum = false;
    // Speculation: the held delivery was already applied with scale 1 and `spec_hyper`, each
    // chunk whose gradient was finite (`spec_chunks`); the commit keeps or redoes it.
    bool speculated = false;
    kernels::AdamWHyper spec_hyper;
    std::vector<uint8_t> spec_chunks;
    std::vector<double> partial;  // per-chunk sums of squares
    double sumsq = 0;
    std::atomic<int64_t> remaining{0};
    // True (released before the chunks are queued) while a speculation is queued or running: a
    // commit asked meanwhile sums the gradient's squares itself (`norm_partial`, counted down by
    // `norm_remaining`) rather than wait for the update.
    std::atomic<bool> speculating{false};
    std::vector<double> norm_partial;
    std::atomic<int64_t> norm_remaining{0};
    // Dispatcher: a member of the running commit whose norm comes from norm_partial.
    bool norm_by_commit = false;
    // Under state_mu_: its optimizer moved out of tsd (RetireBuckets); its state pages are gone.
    bool retired = false;
    int64_t steps = 0;
    uint64_t sr_seed = 0;
    std::chrono::steady_clock::time_point started;  // when the update in flight was dispatched
  };

  void DispatchLoop();
  // One pass over the page; returns false after a failure.
  bool Scan() ABSL_LOCKS_EXCLUDED(state_mu_);
  // The commit counter the clients asked for: the header's, or with world > 1 the lowest of the
  // ranks' (each must be the commits applied or one more). False after a failure.
  bool ReadCommit(uint64_t* commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  bool TakeDelivery(size_t b, uint64_t ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // A bucket's final gradient of a step: its grad slot, or (accumulated) the fp32 accumulator.
  struct FinalGrad {
    const void* data = nullptr;
    kernels::DType dtype = kernels::DType::kF32;
  };
  static FinalGrad FinalGradOf(const BucketRun& run, bool from_accum);
  // The sum of squares of elements [begin, begin + n) of a final gradient (one chunk's part of the
  // norm; every pass that sums a bucket uses it, so the parts are the same bit for bit).
  double ChunkSumSquares(const FinalGrad& g, int64_t begin, int64_t n) const;
  // Clipping: sums the squares of the bucket's final gradient (its grad slot, or the accumulator)
  // on the pool, then holds the bucket until the commit.
  void HoldForCommit(size_t b, bool from_accum);
  // The end of a hold (held or speculated): the bucket's sum of squares from its chunks', the
  // bucket held and released to the dispatcher, which is woken.
  void Held(BucketRun& run);
  // Starts the commit the client asked for once every final delivery is held or speculating
  // (job_optimizer_commit.cc): the norm from what is known plus passes of its own over the
  // gradients still being speculated on, then AdvanceCommit.
  void MaybeApplyCommit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // A commit's own sums of squares of bucket b's final gradient, ahead of the queued updates.
  void SumSquaresForCommit(size_t b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Decides the running commit once its norm is known (coefficient, the hyperparameters of the
  // step), then applies each member no longer busy; the dispatcher calls it again on each wake.
  void AdvanceCommit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Applies the decided commit to held bucket b: keeps, redoes or (held, not speculated) steps it.
  void ApplyCommitTo(size_t b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // The commit's last bucket is done: the page's `committed` counter, and the waiters woken.
  void PublishCommit(uint64_t target);
  // Whether bucket b's final delivery of this step may be applied before its commit: the plan
  // allows it, the bucket has stepped before, and the last step's norm was under
  // kSpeculateBelow of the limit (so clipping most likely will not bite).
  bool ShouldSpeculate(size_t b) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Speculation: per chunk, sums the squares of the final gradient and, when finite, applies
  // the step with scale 1; then holds the bucket for the commit like HoldForCommit.
  void SpeculateBucket(size_t b, bool from_accum);
  // At a commit that cannot keep a speculated update: per chunk, undoes it (AdamWUndo with the
  // speculation's hyperparameters) and applies the step with `h` (the commit's coefficient).
  void RedoBucket(size_t b, const void* grad, kernels::DType grad_dtype,
                  const kernels::AdamWHyper& h, std::function<void()> after);
  // Resume: undoes the speculated update of a held bucket whose commit will never come.
  void UndoSpeculation(size_t b);
  // A client's list of buckets (save_state, retire_buckets): INVALID_ARGUMENT, naming `request`,
  // unless every index exists and they are strictly ascending.
  absl::Status CheckBucketList(absl::string_view request, absl::Span<const uint32_t> buckets) const;
  // The group's hyperparameters from the page (checked; the page is the client's).
  absl::StatusOr<kernels::AdamWHyper> PageHyper(uint32_t group) const;
  // The bucket's next step: the page's hyperparameters (or `fixed`, a commit's snapshot) and its
  // step count, incremented; nullopt (the optimizer failed) when the page's values are invalid.
  std::optional<kernels::AdamWHyper> NextStepHyper(BucketRun& run,
                                                   const kernels::AdamWHyper* fixed = nullptr);
  // The tensors of bucket `run`'s elements [begin, begin + n) for the kernels.
  kernels::AdamWTensors Tensors(const BucketRun& run, const void* grad, kernels::DType grad_dtype,
                                int64_t begin, int64_t n) const;
  // After a bucket's update: its latency into the stats, and its step count published.
  void RecordLatency(size_t b);
  void PublishStep(size_t b);
  // Runs `fn(begin, n, chunk)` over a bucket in chunks (chunks.h): inline when small, else on
  // the pool at the bucket's priority; `done` runs once after the last chunk.
  void RunChunked(size_t b, std::function<void(int64_t, int64_t, size_t)> fn,
                  std::function<void()> done);
  // The same over n elements, counting down `remaining`, at `priority`.
  void RunChunkedOn(int64_t n, std::atomic<int64_t>& remaining, uint64_t priority,
                    std::function<void(int64_t, int64_t, size_t)> fn, std::function<void()> done);
  // Runs `work` and adds its wall time to work_busy_ns_ (the job's bucket work, JobActivity).
  template <typename F>
  void TimeWork(F&& work) {
    const auto start = std::chrono::steady_clock::now();
    std::forward<F>(work)();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start);
    work_busy_ns_.fetch_add(static_cast<uint64_t>(ns.count()), std::memory_order_relaxed);
  }
  // One AdamW step of bucket b with `grad` scaled by `grad_scale`, then `after`. The
  // hyperparameters are the page's now, or `fixed` (a commit's snapshot of its step's: a bucket
  // the commit applies after publishing others must not see the next step's, which the trainer
  // may already have written).
  void StepBucket(size_t b, const void* grad, kernels::DType grad_dtype, float grad_scale,
                  std::function<void()> after, const kernels::AdamWHyper* fixed = nullptr);
  void CompleteDelivery(size_t b);
  // The bucket's place in the queue: the client's forward order (page), else after all of those.
  uint64_t Priority(size_t b) const;
  void Kick();
  void Fail(const std::string& why, bool resumable = false);
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);

  const std::string job_;
  const OptimizerPlan plan_;
  const OptimizerRegions regions_;
  WorkerPool& pool_;
  std::shared_ptr<WorkerPool::Queue> queue_;
  const kernels::Isa isa_;
  const std::shared_ptr<OptimizerObserver> observer_;
  std::atomic<int64_t> max_step_{0};  // the highest step any bucket reached (a job's step count)
  StepStats stats_;
  wire::ControlView page_;
  std::vector<std::unique_ptr<BucketRun>> runs_;

  // Serialises SaveState/LoadState with each other and with the dispatcher's Scan (which writes
  // the fields they read); uncontended on the hot path.
  Mutex state_mu_;
  // Commit (clipping) state: the dispatcher's (under state_mu_, taken by Scan), except
  // `commit_left_`, which the last bucket of a commit counts down on a worker.
  uint64_t committed_local_ ABSL_GUARDED_BY(state_mu_) = 0;
  bool commit_running_ ABSL_GUARDED_BY(state_mu_) = false;
  std::atomic<int64_t> commit_left_{0};
  // The running commit: its counter value, whether its norm is known yet (then the coefficient
  // and each member group's hyperparameters, read once), the members still to apply in forward
  // order, whether it kept or redid a speculated update; `norm_left_`: its sums of squares
  // still running on the pool (the last one wakes the dispatcher).
  uint64_t commit_target_ ABSL_GUARDED_BY(state_mu_) = 0;
  bool commit_decided_ ABSL_GUARDED_BY(state_mu_) = false;
  float commit_coef_ ABSL_GUARDED_BY(state_mu_) = 1.0f;
  std::vector<std::optional<kernels::AdamWHyper>> commit_hyper_ ABSL_GUARDED_BY(state_mu_);
  std::vector<size_t> commit_members_ ABSL_GUARDED_BY(state_mu_);
  bool commit_speculated_ ABSL_GUARDED_BY(state_mu_) = false;
  bool commit_redone_ ABSL_GUARDED_BY(state_mu_) = false;
  std::atomic<int64_t> norm_left_{0};
  // The last commit's gradient norm (NaN before the first): whether the next step speculates.
  double last_norm_ ABSL_GUARDED_BY(state_mu_) = std::numeric_limits<double>::quiet_NaN();
  // Commits that had speculated updates, and those of them that redid any (JobActivity).
  std::atomic<uint64_t> speculated_commits_{0};
  std::atomic<uint64_t> redone_commits_{0};
  // Nanoseconds the pool's threads (and the dispatcher, for small buckets) spent in this job's
  // bucket work (JobActivity.work_busy_s).
  std::atomic<uint64_t> work_busy_ns_{0};
  // Buckets retired (RetireBuckets); each run's `retired` says which.
  std::atomic<size_t> retired_count_{0};

  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  mutable Mutex failure_mu_;
  std::string failure_ ABSL_GUARDED_BY(failure_mu_);
  bool resumable_ ABSL_GUARDED_BY(failure_mu_) = false;
  // Serialises Start/Stop/Revive (each touches dispatcher_).
  Mutex lifecycle_mu_;
  std::thread dispatcher_;
};

// A restarted data-parallel group's resume of a kept optimizer (Registry::TakeOverRank): every
// rank of the group resumes, the first one to get here revives and settles the optimizer, and
// every rank gets the same ResumePoint (or the same error), so no rank sees another step.
class GroupResume final {
 public:
  absl::StatusOr<JobOptimizer::ResumePoint> Settle(JobOptimizer& optimizer, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<JobOptimizer::ResumePoint> result_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tsd
