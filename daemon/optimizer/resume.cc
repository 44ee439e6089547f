// Registrar::Resume: a restarted trainer's registration takes over its kept job's optimizer
// (docs/daemon.md, "Kept jobs and resuming"). The request is planned as a new registration would
// be, compared with the kept optimizer's plan, and, when they match, answered with the kept
// layout (the client maps the same regions) and a report of where each bucket stands. A
// data-parallel job (world > 1) is resumed by every rank of a restarted group of the same world,
// which all get the same report (Registry::TakeOverRank, GroupResume).
#include "absl/strings/str_cat.h"
#include "daemon/optimizer/registrar.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

// How long a resume waits for the work the dead trainer left to finish.
constexpr absl::Duration kSettleTimeout = absl::Seconds(60);

}  // namespace

absl::StatusOr<v1::RegisterOptimizerResponse> Registrar::Resume(
    uint64_t session_id, const v1::RegisterOptimizerRequest& req) {
  const RegistryOptions options = registry_.options();
  if (options.pool == nullptr) {
    return absl::InternalError("this daemon runs without an optimizer engine");
  }
  TSD_ASSIGN_OR_RETURN(const OptimizerPlan asked, JobOptimizer::Plan(req, options.pool_bytes));
  const auto same = [&](const OptimizerPlan& kept) {
    return JobOptimizer::CheckSameLayout(kept, asked);
  };
  std::shared_ptr<JobOptimizer> optimizer;
  JobOptimizer::ResumePoint point;
  if (asked.world > 1) {
    // A rank of a restarted data-parallel group: the group's first rank revives and settles the
    // optimizer, and every rank gets the same report.
    TSD_ASSIGN_OR_RETURN(Registry::RankTakeOver taken,
                         registry_.TakeOverRank(session_id, asked.rank, asked.world, same));
    optimizer = std::move(taken.optimizer);
    TSD_ASSIGN_OR_RETURN(point, taken.group->Settle(*optimizer, kSettleTimeout));
  } else {
    TSD_ASSIGN_OR_RETURN(optimizer, registry_.TakeOverOptimizer(session_id, same));
    TSD_ASSIGN_OR_RETURN(point, optimizer->Resume(kSettleTimeout));
  }
  const OptimizerPlan& layout = optimizer->plan();
  v1::RegisterOptimizerResponse resp = LayoutResponse(layout, options);
  v1::ResumeReport* report = resp.mutable_resume();
  for (uint64_t s : point.bucket_steps) report->add_bucket_steps(s);
  report->set_committed(point.committed);
  for (uint32_t b : point.rolled_back) report->add_rolled_back(b);
  for (uint32_t b : point.dropped_partial) report->add_dropped_partial(b);
  return resp;
}

}  // namespace tsd
