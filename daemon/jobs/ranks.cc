// Data-parallel ranks: the Registry's side of several sessions of one job sharing its optimizer.
//
// The ranks of a node are sessions of one job (so of one uid: Attach refuses another uid's job).
// The first rank's registration creates the optimizer for a world of N ranks; each other rank's
// joins it here: same world, same layout (JobOptimizer::CheckSameLayout), a rank in range that no
// live session holds. The masters and moments exist once; every rank maps the same regions.
// A rank whose session ends other than by Detach (its process died) fails the optimizer, so every
// other rank's next wait on tsd reports which rank was lost instead of waiting for it forever.
// That failure is resumable (JobOptimizer::Abort): nothing is wrong with the state, so a job kept
// with keep_for can be taken over by a restarted group of as many ranks, each resuming
// (TakeOverRank): the first rank revives and settles the optimizer once for the whole group
// (GroupResume), as a single trainer's resume does. A failure found on the page (a protocol
// violation) stays final.
#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {

absl::Status Registry::CheckRankFree(const Job& job, uint64_t session_id, uint32_t rank,
                                     absl::string_view how) {
  for (const auto& [r, sid] : job.ranks) {
    if (sid == session_id) {
      return absl::AlreadyExistsError(
          absl::StrCat("this session already holds rank ", r, " of job '", job.name, "'"));
    }
  }
  if (auto held = job.ranks.find(rank); held != job.ranks.end()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", rank, " of job '", job.name, "' is already held by session ", held->second,
        "; every rank must ", how, " once, with its own rank (torch.distributed.get_rank())"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<JobOptimizer>> Registry::JoinOptimizer(
    uint64_t session_id, uint32_t rank, uint32_t world,
    const std::function<absl::Status(const OptimizerPlan&)>& check) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  Job& job = jobs_.at(session->job);
  if (job.optimizer == nullptr) {
    return absl::NotFoundError(absl::StrCat("job '", job.name, "' has no optimizer to join yet"));
  }
  const OptimizerPlan& plan = job.optimizer->plan();
  if (plan.world <= 1) {
    return absl::AlreadyExistsError(absl::StrCat(
        "job '", job.name,
        "' already has an optimizer, registered by one process (without world); data-parallel "
        "ranks must all register with the same world (wrap(..., distributed=True)), or use "
        "another job name"));
  }
  if (plan.world != world) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.name, "''s optimizer is shared by a world of ", plan.world,
                     " ranks, but this registration says world ", world,
                     "; every rank must be launched with the same world size"));
  }
  if (job.optimizer->failed()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "''s optimizer was stopped (", job.optimizer->failure(), "); ",
        job.optimizer->resumable() && job.keep_for > absl::ZeroDuration()
            ? "restart every rank with resume=True to continue it, or under another job name"
            : "restart every rank under another job name"));
  }
  if (job.group_resume != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.name,
                     "''s other ranks resumed its kept optimizer: this rank must register with "
                     "resume=True as well (every rank of a restarted group resumes)"));
  }
  TSD_RETURN_IF_ERROR(CheckRankFree(job, session_id, rank, "register"));
  TSD_RETURN_IF_ERROR(check(plan));
  job.ranks[rank] = session_id;
  spdlog::info("event=optimizer_joined job={} session={} rank={} world={} ranks={}", job.name,
               session_id, rank, world, job.ranks.size());
  return job.optimizer;
}

void Registry::RankEndedLocked(Job& job, uint64_t session_id, ReleaseReason why) {
  for (auto it = job.ranks.begin(); it != job.ranks.end(); ++it) {
    if (it->second != session_id) continue;
    const uint32_t rank = it->first;
    job.ranks.erase(it);
    if (why == ReleaseReason::kDetach || job.optimizer == nullptr) return;
    // Nothing is wrong with the state: a kept job's restarted group may resume it.
    job.group_resume = nullptr;
    job.optimizer->Abort(
        absl::StrCat("rank ", rank, " of job '", job.name, "' (session ", session_id, ") ended (",
                     ReleaseReasonName(why),
                     ") with its ranks still training; the step fails for every rank: restart "
                     "them all",
                     job.keep_for > absl::ZeroDuration()
                         ? " (with resume=True to continue from the state tsd keeps)"
                         : ""),
        /*resumable=*/true);
    return;
  }
}

absl::StatusOr<Registry::RankTakeOver> Registry::TakeOverRank(
    uint64_t session_id, uint32_t rank, uint32_t world,
    const std::function<absl::Status(const OptimizerPlan&)>& check) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  Job& job = jobs_.at(session->job);
  if (job.optimizer == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "job '", job.name,
        "' has no optimizer to resume (its ranks died before registering one); register "
        "without resume"));
  }
  const OptimizerPlan& plan = job.optimizer->plan();
  if (plan.world <= 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name,
        "''s optimizer was registered by one process (without world); resume it from one process "
        "(without distributed=), or start the data-parallel run under another job name"));
  }
  if (plan.world != world) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name, "''s kept optimizer is shared by a world of ", plan.world,
        " ranks on this node, but this resume says world ", world,
        "; restart the job with as many ranks per node as the run that died (or start afresh "
        "under another job name)"));
  }
  if (job.keep_for <= absl::ZeroDuration()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job.name,
        "' was not kept (no keep_for): a data-parallel job can be resumed only when its ranks "
        "attached with keep_for (wrap(..., keep_for=\"10m\")); start afresh"));
  }
  if (job.group_resume == nullptr) {
    // The first rank of a restarted group: the optimizer must have stopped because a rank was
    // lost, and every rank of the group that lost it must be gone.
    if (!job.optimizer->failed()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", job.name, "''s optimizer is driven by ", job.ranks.size(),
                       " live ranks; only a job whose ranks died can be resumed"));
    }
    if (!job.optimizer->resumable()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", job.name, "''s optimizer was stopped (", job.optimizer->failure(),
                       "); it cannot be resumed: start the job afresh under another name"));
    }
    for (const auto& [r, sid] : job.ranks) {
      if (sessions_.count(sid) != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("rank ", r, " of the group that lost a rank of job '", job.name,
                         "' is still attached (session ", sid,
                         "); every rank of that group must exit before a restarted group resumes"));
      }
    }
  }
  TSD_RETURN_IF_ERROR(CheckRankFree(job, session_id, rank, "resume"));
  TSD_RETURN_IF_ERROR(check(plan));
  if (job.group_resume == nullptr) {
    job.group_resume = std::make_shared<GroupResume>();
    job.ranks.clear();  // the lost group's, all ended
  }
  job.ranks[rank] = session_id;
  // The session Sweep tells if the optimizer fails: the group's first rank, once it is revived
  // (Sweep leaves a stopped optimizer alone while its group resumes).
  if (rank == 0 || sessions_.count(job.optimizer_session) == 0) job.optimizer_session = session_id;
  spdlog::info("event=optimizer_rank_resumed job={} session={} rank={} world={} ranks={}", job.name,
               session_id, rank, world, job.ranks.size());
  return RankTakeOver{job.optimizer, job.group_resume};
}

}  // namespace tsd
