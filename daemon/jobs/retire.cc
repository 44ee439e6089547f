// The Registry's side of retiring optimizer buckets (JobOptimizer::RetireBuckets): the trainer's
// GPU share took their optimizer over, so the memory of their moments goes back to the kernel and
// the job's charge drops by as much, which leaves that room in the pool for other jobs.
//
// The punching runs outside the Registry's lock (many GiB take a while, and every other session
// needs the lock); the charge is lowered after it, if the job is still the same instance. A job
// released meanwhile takes its whole charge with it (Ledger::CloseJob), and its regions say how
// much they still held (Region::held_bytes), so the ledger stays exact either way.
#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {

absl::StatusOr<Registry::Retired> Registry::RetireBuckets(uint64_t session_id,
                                                          absl::Span<const uint32_t> buckets,
                                                          bool masters_unpinned) {
  std::shared_ptr<JobOptimizer> optimizer;
  JobRef ref;
  {
    MutexLock lock(mu_);
    TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
    const Job& job = jobs_.at(session->job);
    if (job.optimizer == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("job '", job.name, "' has no optimizer; register one first"));
    }
    // (Data parallel is refused by the optimizer itself, naming why.)
    if (job.optimizer->plan().world <= 1 && job.optimizer_session != session_id) {
      return absl::FailedPreconditionError(absl::StrCat(
          "retire_buckets: job '", job.name, "''s optimizer is driven by session ",
          job.optimizer_session, "; only the session that registered it may retire its buckets"));
    }
    optimizer = job.optimizer;
    ref = JobRef{job.name, job.instance};
  }
  TSD_ASSIGN_OR_RETURN(std::vector<JobOptimizer::Released> released,
                       optimizer->RetireBuckets(buckets, masters_unpinned));
  Retired out;
  out.retired = static_cast<uint32_t>(optimizer->retired());
  MutexLock lock(mu_);
  auto it = jobs_.find(ref.name);
  if (it == jobs_.end() || it->second.instance != ref.instance) return out;  // released meanwhile
  for (const JobOptimizer::Released& r : released) {
    if (absl::Status s = ledger_->Uncharge(Holder::Job(ref.name), r.region, r.bytes); !s.ok()) {
      spdlog::error("event=ledger_mismatch job={} region={} error=\"{}\"", ref.name, r.region,
                    std::string(s.message()));
      continue;
    }
    out.released_bytes += r.bytes;
  }
  return out;
}

}  // namespace tsd
