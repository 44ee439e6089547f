#include "daemon/rpc/service.h"

#include <unistd.h>

#include "daemon/ops/version.h"
#include "daemon/optimizer/job_optimizer.h"
#include "proto/status_convert.h"

namespace tsd {

using wire::ToGrpc;

grpc::Status TsdService::Attach(grpc::ServerContext*, const v1::AttachRequest* req,
                                v1::AttachResponse* resp) {
  auto grant = registry_.BeginAttach(req->job(), req->quota_bytes());
  if (!grant.ok()) return ToGrpc(grant.status());
  resp->mutable_session()->set_session_id(grant->session_id);
  resp->mutable_session()->set_token(std::string(grant->token.begin(), grant->token.end()));
  resp->set_side_socket(side_socket_);
  resp->set_quota_bytes(grant->quota_bytes);
  resp->set_hello_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(registry_.options().hello_timeout)));
  return grpc::Status::OK;
}

grpc::Status TsdService::Detach(grpc::ServerContext*, const v1::DetachRequest* req,
                                v1::DetachResponse* resp) {
  auto released = registry_.Detach(req->session());
  if (!released.ok()) return ToGrpc(released.status());
  resp->set_job_released(*released);
  return grpc::Status::OK;
}

grpc::Status TsdService::Alloc(grpc::ServerContext*, const v1::AllocRequest* req,
                               v1::AllocResponse* resp) {
  auto info = registry_.Alloc(req->session(), req->name(), req->size_bytes());
  if (!info.ok()) return ToGrpc(info.status());
  *resp->mutable_region() = *info;
  return grpc::Status::OK;
}

grpc::Status TsdService::Free(grpc::ServerContext*, const v1::FreeRequest* req,
                              v1::FreeResponse* resp) {
  auto freed = registry_.Free(req->session(), req->region_id());
  if (!freed.ok()) return ToGrpc(freed.status());
  resp->set_freed_bytes(*freed);
  return grpc::Status::OK;
}

grpc::Status TsdService::ListRegions(grpc::ServerContext*, const v1::ListRegionsRequest* req,
                                     v1::ListRegionsResponse* resp) {
  auto regions = registry_.ListRegions(req->session());
  if (!regions.ok()) return ToGrpc(regions.status());
  for (auto& r : *regions) *resp->add_regions() = std::move(r);
  return grpc::Status::OK;
}

grpc::Status TsdService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                v1::StatusResponse* resp) {
  const PoolSnapshot s = registry_.Snapshot();
  resp->set_version(kVersion);
  resp->set_uptime_s(absl::ToDoubleSeconds(absl::Now() - started_));
  resp->set_pool_bytes(s.pool_bytes);
  resp->set_used_bytes(s.used_bytes);
  resp->set_locked(locked_);
  resp->set_jobs(s.jobs);
  resp->set_sessions(s.sessions);
  resp->set_max_job_quota_bytes(registry_.options().max_job_quota_bytes);
  resp->set_pid(static_cast<uint32_t>(getpid()));
  return grpc::Status::OK;
}

grpc::Status TsdService::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                                  v1::ListJobsResponse* resp) {
  for (auto& j : registry_.Jobs()) *resp->add_jobs() = std::move(j);
  return grpc::Status::OK;
}

grpc::Status TsdService::RegisterOptimizer(grpc::ServerContext*,
                                           const v1::RegisterOptimizerRequest* req,
                                           v1::RegisterOptimizerResponse* resp) {
  auto r = registry_.RegisterOptimizer(*req);
  if (!r.ok()) return ToGrpc(r.status());
  *resp = std::move(*r);
  return grpc::Status::OK;
}

// A dry run of registration: the same checks (JobOptimizer::Plan, against the same pool), nothing
// allocated, no session needed.
grpc::Status TsdService::PlanOptimizer(grpc::ServerContext*,
                                       const v1::RegisterOptimizerRequest* req,
                                       v1::PlanOptimizerResponse* resp) {
  const RegistryOptions options = registry_.options();
  if (options.pool == nullptr) {
    return ToGrpc(absl::InternalError("this daemon runs without an optimizer engine"));
  }
  auto plan = JobOptimizer::Plan(*req, options.pool_bytes);
  if (!plan.ok()) return ToGrpc(plan.status());
  for (const auto& b : plan->buckets) {
    auto* l = resp->add_buckets();
    l->set_master_offset(b.master_offset);
    l->set_grad_offset(b.grad_offset);
    l->set_param_offset(b.param_offset);
  }
  resp->set_state_bytes(plan->total_bytes());
  resp->set_control_bytes(plan->control_bytes);
  resp->set_master_bytes(plan->master_bytes);
  resp->set_moment_bytes(plan->moment_bytes);
  resp->set_grad_bytes(plan->grad_bytes);
  resp->set_param_bytes(plan->param_bytes);
  resp->set_accum_bytes(plan->accum_bytes);
  return grpc::Status::OK;
}

}  // namespace tsd
