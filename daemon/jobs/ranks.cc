// Data-parallel ranks: the Registry's side of several sessions of one job sharing its optimizer.
//
// The ranks of a node are sessions of one job (so of one uid: Attach refuses another uid's job).
// The first rank's registration creates the optimizer for a world of N ranks; each other rank's
// joins it here: same world, same layout (JobOptimizer::CheckSameLayout), a rank in range that no
// live session holds. The masters and moments exist once; every rank maps the same regions.
// A rank whose session ends other than by Detach (its process died) fails the optimizer, so every
// other rank's next wait on tsd reports which rank was lost instead of waiting for it forever.
#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {

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
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.name, "''s optimizer was stopped (", job.optimizer->failure(),
                     "); restart every rank under another job name"));
  }
  for (const auto& [r, sid] : job.ranks) {
    if (sid == session_id) {
      return absl::AlreadyExistsError(
          absl::StrCat("this session already holds rank ", r, " of job '", job.name, "'"));
    }
  }
  if (auto held = job.ranks.find(rank); held != job.ranks.end()) {
    return absl::AlreadyExistsError(absl::StrCat(
        "rank ", rank, " of job '", job.name, "' is already held by session ", held->second,
        "; every rank must register once, with its own rank "
        "(torch.distributed.get_rank())"));
  }
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
    job.optimizer->Abort(absl::StrCat("rank ", rank, " of job '", job.name, "' (session ",
                                      session_id, ") ended (", ReleaseReasonName(why),
                                      ") with its ranks still training; the step fails for every "
                                      "rank: restart them all"));
    return;
  }
}

}  // namespace tsd
