#include "daemon/optimizer/registrar.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/optimizer/job_optimizer.h"
#include "spdlog/spdlog.h"

namespace tsd {

absl::StatusOr<v1::RegisterOptimizerResponse> Registrar::Register(
    uint64_t session_id, const v1::RegisterOptimizerRequest& req) {
  if (req.resume()) return Resume(session_id, req);
  const RegistryOptions options = registry_.options();  // a consistent copy (SIGHUP may resize)
  if (options.pool == nullptr) {
    return absl::InternalError("this daemon runs without an optimizer engine");
  }
  auto plan = JobOptimizer::Plan(req, options.pool_bytes);
  if (!plan.ok()) return plan.status();
  if (plan->world > 1) {
    // A data-parallel rank joins the optimizer another rank of the job created, if there is one.
    auto joined = registry_.JoinOptimizer(
        session_id, plan->rank, plan->world, [&](const OptimizerPlan& theirs) {
          return JobOptimizer::CheckSameLayout(theirs, *plan, /*join=*/true);
        });
    if (joined.ok()) return LayoutResponse((*joined)->plan(), options);
    if (joined.status().code() != absl::StatusCode::kNotFound) return joined.status();
  }
  auto job = registry_.PrepareOptimizer(session_id, plan->total_bytes());
  if (!job.ok()) return job.status();
  // The GPU's NUMA node, before the first region: the regions and the workers go there.
  auto node = registry_.PlaceJob(session_id, req.pci_bus_id());
  if (!node.ok()) return node.status();
  plan->numa_node = *node;

  // The regions, in the order of OptimizerRegions' slots; empty ones are not allocated.
  const std::pair<const char*, uint64_t> wanted[] = {
      {"opt/control", plan->control_bytes}, {"opt/master", plan->master_bytes},
      {"opt/exp_avg", plan->moment_bytes},  {"opt/exp_avg_sq", plan->moment_bytes},
      {"opt/grads", plan->grad_bytes},      {"opt/params", plan->param_bytes},
      {"opt/accum", plan->accum_bytes}};
  std::vector<uint64_t> made;
  auto rollback = [&](const absl::Status& why) {
    const uint64_t freed =
        registry_.ReleaseRegions(*job, made, ReleaseReason::kRegistrationRolledBack);
    spdlog::warn(
        "event=optimizer_registration_failed job={} regions_released={} bytes={} "
        "error=\"{}\"",
        job->name, made.size(), freed, std::string(why.message()));
    return why;
  };
  for (const auto& [name, bytes] : wanted) {
    if (bytes == 0) continue;
    auto info = registry_.AllocOptimizerRegion(session_id, name, bytes);
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kAlreadyExists) {
        return rollback(
            absl::AlreadyExistsError("another optimizer registration of this job is in progress"));
      }
      return rollback(info.status());
    }
    made.push_back(info->region_id());
    if (after_alloc_) {
      if (absl::Status s = after_alloc_(made.size()); !s.ok()) return rollback(s);
    }
  }

  const OptimizerPlan& layout = *plan;
  absl::Status installed = registry_.InstallOptimizer(
      session_id, *job, made,
      [&](const std::string& name, const std::vector<std::shared_ptr<Region>>& regions)
          -> absl::StatusOr<std::shared_ptr<JobOptimizer>> {
        OptimizerRegions slots;
        std::shared_ptr<Region>* order[] = {&slots.control,    &slots.master, &slots.exp_avg,
                                            &slots.exp_avg_sq, &slots.grads,  &slots.params,
                                            &slots.accum};
        for (size_t i = 0, m = 0; i < std::size(wanted); ++i) {
          if (wanted[i].second != 0) *order[i] = regions[m++];
        }
        auto optimizer = std::make_shared<JobOptimizer>(
            name, layout, slots, *options.pool, options.isa,
            options.metrics ? options.metrics->ObserverFor(name) : nullptr);
        optimizer->Start();
        return optimizer;
      },
      layout.world > 1 ? static_cast<int64_t>(layout.rank) : -1);
  if (!installed.ok()) return rollback(installed);

  v1::RegisterOptimizerResponse resp = LayoutResponse(layout, options);
  spdlog::info(
      "event=optimizer_registered job={} buckets={} groups={} state_bytes={} isa={} clip={} "
      "accumulate={} world={} numa_node={}",
      job->name, layout.buckets.size(), layout.groups.size(), layout.total_bytes(),
      kernels::IsaName(options.isa), layout.max_grad_norm, layout.accumulate, layout.world,
      layout.numa_node);
  return resp;
}

v1::RegisterOptimizerResponse Registrar::LayoutResponse(const OptimizerPlan& layout,
                                                        const RegistryOptions& options) {
  v1::RegisterOptimizerResponse resp;
  for (const auto& b : layout.buckets) {
    auto* l = resp.add_buckets();
    l->set_master_offset(b.master_offset);
    l->set_grad_offset(b.grad_offset);
    l->set_param_offset(b.param_offset);
  }
  resp.set_state_bytes(layout.total_bytes());
  resp.set_params_in_master(layout.params_in_master);
  resp.set_isa(kernels::IsaName(options.isa));
  resp.set_threads(static_cast<uint32_t>(options.pool->threads()));
  return resp;
}

}  // namespace tsd
