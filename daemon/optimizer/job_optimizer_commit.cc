// JobOptimizer's clipping (max_grad_norm): holding final deliveries for the step's commit,
// speculating on them, and the commit itself (job_optimizer.h, "Clipping" there).
//
// A commit has two phases. First its norm: the sum of squares of every final gradient of the
// step. A held bucket has it already; a bucket whose speculation is still queued or running gets
// a pass of its own over the gradient, ahead of every update on the pool (it reads 2 to 4 bytes
// per parameter, the update about 30). Then, with the coefficient known, each bucket is applied
// as soon as its own work allows: at once when it is held, else when its speculation ends. So the
// client's next forward gets the first buckets it needs while the last speculations still run,
// rather than after all of them, and the threads are not idle during that forward.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/optimizer/chunks.h"
#include "daemon/optimizer/job_optimizer.h"
#include "proto/futex.h"

namespace tsd {
namespace {

// Clipping speculates while the last step's norm is under this fraction of max_grad_norm: a norm
// that grows by more than 1.25x in one step makes it redo (it costs one more pass over the bucket).
constexpr double kSpeculateBelow = 0.8;
// A commit's own sums of squares run before every queued update (the pool runs lower first;
// updates carry the forward order, 1 and up).
constexpr uint64_t kCommitNormPriority = 0;

double SumOf(const std::vector<double>& partial) {
  double s = 0;
  for (double x : partial) s += x;  // chunk order: the same sum whichever pass made the parts
  return s;
}

}  // namespace

double JobOptimizer::ChunkSumSquares(const FinalGrad& g, int64_t begin, int64_t n) const {
  return kernels::SumSquares(static_cast<const char*>(g.data) + begin * kernels::DTypeSize(g.dtype),
                             g.dtype, n, isa_);
}

void JobOptimizer::HoldForCommit(size_t b, bool from_accum) {
  BucketRun& run = *runs_[b];
  run.held_from_accum = from_accum;
  run.partial.assign(chunks::Count(run.plan.numel) + 1, 0.0);
  const FinalGrad g = FinalGradOf(run, from_accum);
  RunChunked(
      b,
      [this, run = &run, g](int64_t begin, int64_t n, size_t chunk) {
        run->partial[chunk] = ChunkSumSquares(g, begin, n);
      },
      [this, run = &run] { Held(*run); });
}

void JobOptimizer::Held(BucketRun& run) {
  run.sumsq = SumOf(run.partial);
  run.held = true;
  run.busy.store(false, std::memory_order_release);
  Kick();
}

void JobOptimizer::MaybeApplyCommit() {
  // Scan read the commit before the deliveries, so every final delivery of the step has been
  // taken: its bucket is held, or speculating. Anything else in flight (an accumulation about to
  // speculate or hold, a hold's sums of squares) is short: wait for it (its end wakes us).
  std::vector<size_t> members;
  for (size_t b = 0; b < runs_.size(); ++b) {
    BucketRun& run = *runs_[b];
    if (run.busy.load(std::memory_order_acquire)) {
      if (!run.speculating.load(std::memory_order_acquire)) return;
      members.push_back(b);
    } else if (run.held) {
      members.push_back(b);
    }
  }
  const uint64_t target = committed_local_ + 1;
  committed_local_ = target;
  commit_target_ = target;
  commit_decided_ = false;
  commit_speculated_ = commit_redone_ = false;
  commit_hyper_.assign(plan_.groups.size(), std::nullopt);
  // In the order the next forward uses the buckets (the client's `order`, a sort key only).
  std::stable_sort(members.begin(), members.end(),
                   [this](size_t a, size_t b) { return Priority(a) < Priority(b); });
  commit_running_ = true;
  commit_left_.store(static_cast<int64_t>(members.size()), std::memory_order_release);
  norm_left_.store(0, std::memory_order_relaxed);
  for (size_t b : members) {
    BucketRun& run = *runs_[b];
    run.norm_by_commit = false;
    // busy only goes from true to false meanwhile (the dispatcher alone sets it): a bucket that
    // is still busy is speculating, and its sum of squares is not known yet.
    if (run.busy.load(std::memory_order_acquire)) SumSquaresForCommit(b);
  }
  commit_members_ = std::move(members);
  AdvanceCommit();
}

void JobOptimizer::SumSquaresForCommit(size_t b) {
  BucketRun& run = *runs_[b];
  run.norm_by_commit = true;
  // held_from_accum was written before `speculating` was released (SpeculateBucket).
  const FinalGrad g = FinalGradOf(run, run.held_from_accum);
  run.norm_partial.assign(chunks::Count(run.plan.numel) + 1, 0.0);
  norm_left_.fetch_add(1, std::memory_order_relaxed);
  RunChunkedOn(
      run.plan.numel, run.norm_remaining, kCommitNormPriority,
      [this, run = &run, g](int64_t begin, int64_t n, size_t chunk) {
        run->norm_partial[chunk] = ChunkSumSquares(g, begin, n);
      },
      [this] {
        if (norm_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) Kick();
      });
}

void JobOptimizer::AdvanceCommit() {
  if (!commit_decided_) {
    if (norm_left_.load(std::memory_order_acquire) != 0) return;  // its last pass wakes us
    // The sum in bucket order, as torch adds its gradients' norms; each bucket's from its chunks.
    std::vector<size_t> by_index = commit_members_;  // none is applied before the norm is known
    std::sort(by_index.begin(), by_index.end());
    double total = 0;
    for (size_t b : by_index) {
      const BucketRun& run = *runs_[b];
      total += run.norm_by_commit ? SumOf(run.norm_partial) : run.sumsq;
    }
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1, fp32.
    const float norm = static_cast<float>(std::sqrt(total));
    float coef = static_cast<float>(plan_.max_grad_norm) / (norm + 1e-6f);
    if (coef > 1.0f) coef = 1.0f;
    page_.header->last_grad_norm = norm;
    last_norm_ = norm;
    commit_coef_ = coef;
    commit_decided_ = true;
    // The step's hyperparameters as they are now: a bucket applied later (its speculation still
    // running) must not see what the trainer writes for the next step meanwhile.
    for (size_t b : commit_members_) {
      const uint32_t group = runs_[b]->plan.group;
      if (commit_hyper_[group]) continue;
      absl::StatusOr<kernels::AdamWHyper> h = PageHyper(group);
      if (!h.ok()) {
        Fail(std::string(h.status().message()));
        return;
      }
      commit_hyper_[group] = *h;
    }
    if (commit_members_.empty()) {
      PublishCommit(commit_target_);
      return;
    }
  }
  // Each member whose own work is over, in the forward's order; the others when their
  // speculation ends (Held() wakes us).
  std::vector<size_t> still;
  for (size_t b : commit_members_) {
    if (runs_[b]->busy.load(std::memory_order_acquire)) {
      still.push_back(b);
    } else {
      ApplyCommitTo(b);
    }
  }
  commit_members_ = std::move(still);
}

void JobOptimizer::ApplyCommitTo(size_t b) {
  BucketRun& run = *runs_[b];
  run.held = false;
  run.busy.store(true, std::memory_order_relaxed);
  const FinalGrad g = FinalGradOf(run, run.held_from_accum);
  auto after = [this, b, target = commit_target_] {
    CompleteDelivery(b);
    if (commit_left_.fetch_sub(1, std::memory_order_acq_rel) == 1) PublishCommit(target);
  };
  const float coef = commit_coef_;
  if (!run.speculated) {
    // The step's hyperparameters as the commit read them: members it published before this one
    // woke the trainer, which may have written the next step's since.
    StepBucket(b, g.data, g.dtype, coef, std::move(after), &*commit_hyper_[run.plan.group]);
    return;
  }
  // Speculated: kept when it is what the commit computes (coefficient 1, the same
  // hyperparameters, every chunk applied), else undone and redone. Counted before anything of
  // the commit is published, so a client that saw the commit sees the counts.
  run.speculated = false;
  if (!commit_speculated_) speculated_commits_.fetch_add(1, std::memory_order_relaxed);
  commit_speculated_ = true;
  kernels::AdamWHyper h = *commit_hyper_[run.plan.group];
  h.step = run.steps;
  h.grad_scale = coef;
  const kernels::AdamWHyper& was = run.spec_hyper;
  const bool same = h.lr == was.lr && h.beta1 == was.beta1 && h.beta2 == was.beta2 &&
                    h.eps == was.eps && h.weight_decay == was.weight_decay;
  const bool whole =
      std::all_of(run.spec_chunks.begin(), run.spec_chunks.end(), [](uint8_t c) { return c != 0; });
  if (coef == 1.0f && same && whole) {
    PublishStep(b);
    after();
    return;
  }
  if (!commit_redone_) redone_commits_.fetch_add(1, std::memory_order_relaxed);
  commit_redone_ = true;
  RedoBucket(b, g.data, g.dtype, h, std::move(after));
}

void JobOptimizer::PublishCommit(uint64_t target) {
  page_.header->committed.store(target, std::memory_order_release);
  page_.header->completions.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&page_.header->completions);
}

bool JobOptimizer::ShouldSpeculate(size_t b) const {
  return plan_.speculate_clip && runs_[b]->steps >= 1 && std::isfinite(last_norm_) &&
         last_norm_ < kSpeculateBelow * plan_.max_grad_norm;
}

void JobOptimizer::SpeculateBucket(size_t b, bool from_accum) {
  BucketRun& run = *runs_[b];
  const std::optional<kernels::AdamWHyper> h = NextStepHyper(run);
  if (!h) return;
  run.spec_hyper = *h;
  run.held_from_accum = from_accum;
  const size_t count = chunks::Count(run.plan.numel);
  run.partial.assign(count + 1, 0.0);
  run.spec_chunks.assign(count, 0);
  const FinalGrad g = FinalGradOf(run, from_accum);
  run.started = std::chrono::steady_clock::now();
  // A commit asked from now on sums this gradient's squares itself rather than wait for the update.
  run.speculating.store(true, std::memory_order_release);
  RunChunked(
      b,
      [this, run = &run, g, hyper = *h](int64_t begin, int64_t n, size_t chunk) {
        const kernels::AdamWTensors t = Tensors(*run, g.data, g.dtype, begin, n);
        // The squares first, in the same pass (the chunk is still in cache for the update): a
        // non-finite chunk is not applied, so its commit never has to undo an Inf or a NaN.
        const double sumsq = ChunkSumSquares(g, begin, n);
        run->partial[chunk] = sumsq;
        if (std::isfinite(sumsq)) {
          kernels::AdamWStep(t, hyper, isa_);
          run->spec_chunks[chunk] = 1;
        }
      },
      [this, b, run = &run] {
        RecordLatency(b);
        run->speculated = true;
        run->speculating.store(false, std::memory_order_relaxed);  // released with busy by Held
        Held(*run);
      });
  // After an accumulation (on a worker) the dispatcher may be waiting to start a commit.
  if (from_accum) Kick();
}

void JobOptimizer::RedoBucket(size_t b, const void* grad, kernels::DType grad_dtype,
                              const kernels::AdamWHyper& h, std::function<void()> after) {
  BucketRun& run = *runs_[b];
  run.started = std::chrono::steady_clock::now();
  RunChunked(
      b,
      [this, run = &run, grad, grad_dtype, h](int64_t begin, int64_t n, size_t chunk) {
        const kernels::AdamWTensors t = Tensors(*run, grad, grad_dtype, begin, n);
        if (run->spec_chunks[chunk] != 0) kernels::AdamWUndo(t, run->spec_hyper);
        kernels::AdamWStep(t, h, isa_);
      },
      [this, b, after = std::move(after)] {
        RecordLatency(b);
        PublishStep(b);
        after();
      });
}

void JobOptimizer::UndoSpeculation(size_t b) {
  BucketRun& run = *runs_[b];
  const FinalGrad g = FinalGradOf(run, run.held_from_accum);
  for (size_t c = 0; c < run.spec_chunks.size(); ++c) {
    if (run.spec_chunks[c] == 0) continue;
    const int64_t begin = static_cast<int64_t>(c) * chunks::kChunk;
    const int64_t n = std::min(chunks::kChunk, run.plan.numel - begin);
    kernels::AdamWUndo(Tensors(run, g.data, g.dtype, begin, n), run.spec_hyper);
  }
  --run.steps;
  run.speculated = false;
}

}  // namespace tsd
