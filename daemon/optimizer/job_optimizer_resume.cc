// JobOptimizer's side of resuming a kept job (daemon/jobs/keep.cc): settling what a trainer that
// died left on the control page, and checking that a new registration describes the same
// optimizer.
//
// A trainer can die at any point of a step. Whatever it had rung before it died is whole (it
// writes a gradient before it publishes the delivery), so the daemon finishes it: an update in
// flight always completes, never leaving a torn master or moment. What it cannot finish are
// deliveries that wait for the trainer: with clipping, final deliveries held until the step's
// commit; with accumulation, a bucket's partial sum. Both are dropped (rolled back) and the new
// trainer starts at a step boundary. A held delivery that was speculated (applied before the
// commit, job_optimizer.cc) is undone first; the others changed no master or moment. Buckets that
// were updated in the interrupted step (without clipping they update as backward goes) keep
// their update: their step counts say so, and the client decides what to do with them.
//
// Data parallel: a rank that died fails the optimizer for its group, resumably (Abort); a
// restarted group's first rank revives it (Revive: the dispatcher starts again) and settles it
// as above, once for the group (GroupResume). A commit only some ranks asked never ran: the
// ranks' commit counters go back to the commits applied.
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/optimizer/job_optimizer.h"
#include "kernels/cpu/adamw.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

const char* DTypeName(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return "float32";
    case kernels::DType::kBF16:
      return "bfloat16";
    case kernels::DType::kF16:
      return "float16";
  }
  return "?";
}

}  // namespace

absl::Status JobOptimizer::CheckSameLayout(const OptimizerPlan& kept, const OptimizerPlan& asked,
                                           bool join) {
  const auto differ = [join](const std::string& what) {
    return absl::FailedPreconditionError(
        join ? absl::StrCat("this rank's registration does not match the optimizer the job's "
                            "other ranks registered: ",
                            what,
                            "; every rank must wrap the same model with the same optimizer "
                            "groups and wrap() options")
             : absl::StrCat("the registration does not match the kept job's optimizer: ", what,
                            "; resume with the same model, parameter groups and wrap() options "
                            "as the run that died (or start afresh under another job name)"));
  };
  const char* theirs = join ? "the other ranks' optimizer" : "the kept job";
  if (kept.groups.size() != asked.groups.size()) {
    return differ(absl::StrCat(theirs, " has ", kept.groups.size(), " parameter groups, this ",
                               "registration ", asked.groups.size()));
  }
  if (kept.buckets.size() != asked.buckets.size()) {
    return differ(absl::StrCat(theirs, " has ", kept.buckets.size(),
                               " trainable parameters (buckets), this registration ",
                               asked.buckets.size()));
  }
  for (size_t b = 0; b < kept.buckets.size(); ++b) {
    const BucketPlan &k = kept.buckets[b], &a = asked.buckets[b];
    if (k.numel != a.numel) {
      return differ(absl::StrCat("bucket ", b, " has ", k.numel, " elements in ", theirs, ", ",
                                 a.numel, " here"));
    }
    if (k.group != a.group) {
      return differ(absl::StrCat("bucket ", b, " is in parameter group ", k.group, " in ", theirs,
                                 ", ", a.group, " here"));
    }
    if (k.grad_dtype != a.grad_dtype || k.param_dtype != a.param_dtype) {
      return differ(absl::StrCat("bucket ", b, " is ", DTypeName(k.param_dtype), " (gradients ",
                                 DTypeName(k.grad_dtype), ") in ", theirs, ", ",
                                 DTypeName(a.param_dtype), " (gradients ", DTypeName(a.grad_dtype),
                                 ") here"));
    }
  }
  if (kept.moment_dtype != asked.moment_dtype) {
    return differ(absl::StrCat(theirs, "'s moments are ", DTypeName(kept.moment_dtype),
                               ", this registration asks ", DTypeName(asked.moment_dtype)));
  }
  if (kept.max_grad_norm != asked.max_grad_norm) {
    return differ(absl::StrCat(theirs, " clips at max_grad_norm=", kept.max_grad_norm,
                               ", this registration asks ", asked.max_grad_norm));
  }
  if (kept.accumulate != asked.accumulate) {
    return differ(absl::StrCat(theirs, " was registered with", kept.accumulate ? "" : "out",
                               " gradient accumulation, this ", "registration ",
                               asked.accumulate ? "with" : "without"));
  }
  if (kept.seed != asked.seed) {
    return differ(absl::StrCat(theirs, "'s stochastic-rounding seed is ", kept.seed,
                               ", this registration's ", asked.seed));
  }
  if (kept.world != asked.world) {
    return differ(absl::StrCat(theirs, " is shared by a world of ", kept.world,
                               " data-parallel ranks, this registration asks ", asked.world));
  }
  return absl::OkStatus();
}

absl::Status JobOptimizer::Revive() {
  MutexLock lifecycle(lifecycle_mu_);
  if (!failed()) return absl::OkStatus();
  if (!resumable()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the kept optimizer of job '", job_, "' has stopped: ", failure()));
  }
  if (stop_.load()) return absl::FailedPreconditionError("the optimizer is being released");
  // The dispatcher leaves its loop once it sees the failure (the kick wakes it at once).
  Kick();
  if (dispatcher_.joinable()) dispatcher_.join();
  {
    MutexLock lock(failure_mu_);
    spdlog::info("event=optimizer_revived job={} after=\"{}\"", job_, failure_);
    failure_.clear();
    resumable_ = false;
    page_.header->error[0] = '\0';
    page_.header->failed.store(0, std::memory_order_release);
    failed_.store(false);
  }
  dispatcher_ = std::thread([this] { DispatchLoop(); });
  return absl::OkStatus();
}

absl::StatusOr<JobOptimizer::ResumePoint> GroupResume::Settle(JobOptimizer& optimizer,
                                                              absl::Duration timeout) {
  MutexLock lock(mu_);
  if (!done_) {
    absl::Status revived = optimizer.Revive();
    result_ = revived.ok() ? optimizer.Resume(timeout)
                           : absl::StatusOr<JobOptimizer::ResumePoint>(revived);
    done_ = true;
  }
  return result_;
}

absl::StatusOr<JobOptimizer::ResumePoint> JobOptimizer::Resume(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (failed()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the kept optimizer of job '", job_, "' has stopped: ", failure()));
    }
    {
      MutexLock lock(state_mu_);
      // Work the dead trainer started must end first: an update in flight, a delivery rung but
      // not yet taken, a commit asked but not yet applied.
      // Data parallel: a commit runs once every rank asked for it (ReadCommit: the lowest of
      // the ranks' counters); one that only some ranks asked before a rank died never runs. A
      // counter the dispatcher would refuse fails the optimizer here as there.
      uint64_t asked = 0;
      bool settled = ReadCommit(&asked) &&
                     !(commit_running_ && commit_left_.load(std::memory_order_acquire) != 0) &&
                     asked == committed_local_;
      for (size_t b = 0; settled && b < runs_.size(); ++b) {
        const BucketRun& r = *runs_[b];
        settled = !r.busy.load(std::memory_order_acquire) &&
                  page_.buckets[b].ready.load(std::memory_order_acquire) == r.done_local;
      }
      if (settled) {
        ResumePoint point;
        for (size_t b = 0; b < runs_.size(); ++b) {
          BucketRun& r = *runs_[b];
          if (r.held) {
            // A final delivery waiting for a commit: dropped. A speculated one was applied: it
            // is undone (to within rounding, kernels/cpu/adamw_undo.cc).
            if (r.speculated) UndoSpeculation(b);
            r.held = false;
            page_.buckets[b].done.store(r.pending, std::memory_order_release);
            point.rolled_back.push_back(static_cast<uint32_t>(b));
          } else if (r.done_local > 0 && (page_.buckets[b].flags.load(std::memory_order_acquire) &
                                          wire::kDeliveryFinal) == 0) {
            // The accumulator holds a partial sum; the next trainer's first delivery of a step
            // (kDeliveryFirst) starts it afresh.
            point.dropped_partial.push_back(static_cast<uint32_t>(b));
          }
          point.bucket_steps.push_back(static_cast<uint64_t>(r.steps));
        }
        point.committed = committed_local_;
        if (plan_.world > 1) {
          // The commits some ranks asked were dropped with the held deliveries: every rank of
          // the restarted group continues from the commits applied.
          for (uint32_t r = 0; r < plan_.world; ++r) {
            page_.ranks[r].commit.store(committed_local_, std::memory_order_release);
          }
        }
        spdlog::info(
            "event=optimizer_settled job={} committed={} rolled_back={} dropped_partial={}", job_,
            point.committed, point.rolled_back.size(), point.dropped_partial.size());
        return point;
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("the kept optimizer of job '", job_,
                       "' did not finish the work its last trainer left "
                       "within ",
                       absl::FormatDuration(timeout), "; try resuming again"));
    }
    Kick();  // the dispatcher takes what was rung
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace tsd
