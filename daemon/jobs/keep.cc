// Kept jobs: a job may ask (AttachOptions::keep_for) to outlive its last session by a while, so
// that a trainer that died (killed, out of memory, preempted) can be restarted and continue from
// the optimizer state tsd holds. These are the Registry's methods for it; the bookkeeping of
// orphaned jobs itself (when they are released) stays in registry.cc.
//
// The rules: keep_for is bounded by the daemon's max_keep_for (refused above it, saying the
// limit); only the job's uid attaches to it (as for every attach); an attach without `resume` to
// a job kept after its trainer died is refused, so a restarted trainer never joins old state
// unknowingly; an attach with `resume` to a job that does not exist is refused. A session that
// resumed takes over the job's optimizer once its registration matches the kept one. A
// data-parallel job is resumed by a restarted group of as many ranks, each resuming
// (Registry::TakeOverRank in ranks.cc), never by one process.
#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {

absl::Duration Registry::GraceLocked(const Job& job) const {
  return job.keep_for > absl::ZeroDuration() ? job.keep_for : options_.orphan_grace;
}

absl::Status Registry::CheckAttachOptionsLocked(const std::string& job, const Job* existing,
                                                const AttachOptions& extra) const {
  if (extra.keep_for < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("keep_for is negative (", absl::FormatDuration(extra.keep_for), ")"));
  }
  if (extra.keep_for > options_.max_keep_for) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keep_for ", absl::FormatDuration(extra.keep_for), " is longer than this daemon's ",
        "max_keep_for (", absl::FormatDuration(options_.max_keep_for),
        "); ask for less, or have the administrator raise max_keep_for in tsd.toml"));
  }
  if (extra.resume && existing == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "there is no job '", job,
        "' to resume: it was never created, its keep_for ran out, or it was detached; start it "
        "afresh (without resume)"));
  }
  if (!extra.resume && existing != nullptr && existing->sessions.empty() &&
      existing->optimizer != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job,
                     "' is kept after its last trainer died (its optimizer state is still in tsd); "
                     "attach with resume=True to continue it, or pick another job name"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<JobOptimizer>> Registry::TakeOverOptimizer(
    uint64_t session_id, const std::function<absl::Status(const OptimizerPlan&)>& check) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  Job& job = jobs_.at(session->job);
  if (job.optimizer == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "job '", job.name,
        "' has no optimizer to resume (its trainer died before registering one); register "
        "without resume"));
  }
  if (job.optimizer->plan().world > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "''s kept optimizer is shared by a world of ",
        job.optimizer->plan().world,
        " data-parallel ranks, but this resume comes from one process; restart as many ranks, "
        "each resuming (wrap(..., distributed=True, resume=True))"));
  }
  if (job.optimizer->failed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.name, "''s optimizer was stopped (", job.optimizer->failure(),
                     "); it cannot be resumed: start the job afresh under another name"));
  }
  if (const size_t gone = job.optimizer->retired(); gone > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "''s kept optimizer retired ", gone,
        " buckets to its trainer's GPU share, whose state died with the trainer; it cannot be "
        "resumed: start the job afresh under another name (resume takes "
        "optimizer_gpu_fraction=0)"));
  }
  if (job.optimizer_session != 0 && job.optimizer_session != session_id &&
      sessions_.count(job.optimizer_session) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.name, "''s optimizer is driven by live session ",
                     job.optimizer_session, "; only a job whose trainer died can be resumed"));
  }
  TSD_RETURN_IF_ERROR(check(job.optimizer->plan()));
  job.optimizer_session = session_id;
  spdlog::info("event=optimizer_resumed job={} session={}", job.name, session_id);
  return job.optimizer;
}

absl::StatusOr<std::shared_ptr<JobOptimizer>> Registry::OptimizerForCheckpoint(
    const std::string& job, uid_t uid) {
  TSD_RETURN_IF_ERROR(wire::ValidateName("job", job));
  MutexLock lock(mu_);
  auto it = jobs_.find(job);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("there is no job '", job, "' (see tsctl jobs)"));
  }
  if (it->second.uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("job '", job, "' belongs to uid ",
                                                    it->second.uid, "; uid ", uid,
                                                    " may not checkpoint it"));
  }
  if (it->second.optimizer == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("job '", job, "' has no optimizer: there is no state to checkpoint"));
  }
  return it->second.optimizer;
}

}  // namespace tsd
