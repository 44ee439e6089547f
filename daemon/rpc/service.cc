#include "daemon/rpc/service.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/ops/version.h"
#include "daemon/optimizer/job_optimizer.h"
#include "daemon/rpc/side_handler.h"
#include "proto/side_message.h"
#include "proto/status_convert.h"
#include "proto/wire.h"

namespace tsd {

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* TsdService::Raw(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req, grpc::ByteBuffer* resp,
                                          const char* method,
                                          grpc::Status (TsdService::*typed)(grpc::ServerContext*,
                                                                            const Req*, Resp*)) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::string bytes;
  std::vector<grpc::Slice> slices;
  if (req != nullptr && req->Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  Req request;
  if (!request.ParseFromString(bytes)) {
    const std::string type = Req::descriptor()->full_name();
    reactor->Finish(grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat("the ", method, " request (", bytes.size(), " bytes) is not a valid ", type,
                     ": ", wire::ExplainParseFailure(bytes, type),
                     "; is the client built from another tsd.proto?")));
    return reactor;
  }
  Resp response;
  const grpc::Status s = (this->*typed)(nullptr, &request, &response);
  if (s.ok()) {
    grpc::Slice slice(response.SerializeAsString());
    *resp = grpc::ByteBuffer(&slice, 1);
  }
  reactor->Finish(s);
  return reactor;
}

grpc::ServerUnaryReactor* TsdService::Status(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) {
  return Raw<v1::StatusRequest, v1::StatusResponse>(ctx, req, resp, "Status", &TsdService::Status);
}
grpc::ServerUnaryReactor* TsdService::ListJobs(grpc::CallbackServerContext* ctx,
                                               const grpc::ByteBuffer* req,
                                               grpc::ByteBuffer* resp) {
  return Raw<v1::ListJobsRequest, v1::ListJobsResponse>(ctx, req, resp, "ListJobs",
                                                        &TsdService::ListJobs);
}
grpc::ServerUnaryReactor* TsdService::PlanOptimizer(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return Raw<v1::RegisterOptimizerRequest, v1::PlanOptimizerResponse>(
      ctx, req, resp, "PlanOptimizer", &TsdService::PlanOptimizer);
}
grpc::ServerUnaryReactor* TsdService::Attach(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* req, grpc::ByteBuffer* resp) {
  return Raw<v1::RetiredRequest, v1::RetiredResponse>(ctx, req, resp, "Attach",
                                                      &TsdService::Attach);
}

grpc::ServerUnaryReactor* TsdService::ListStores(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* req,
                                                 grpc::ByteBuffer* resp) {
  return Raw<v1::ListStoresRequest, v1::ListStoresResponse>(ctx, req, resp, "ListStores",
                                                            &TsdService::ListStores);
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
  resp->set_protocol_version(wire::kProtocolVersion);
  return grpc::Status::OK;
}

grpc::Status TsdService::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                                  v1::ListJobsResponse* resp) {
  for (auto& j : registry_.Jobs()) *resp->add_jobs() = std::move(j);
  return grpc::Status::OK;
}

grpc::Status TsdService::Attach(grpc::ServerContext*, const v1::RetiredRequest*,
                                v1::RetiredResponse*) {
  return grpc::Status(
      grpc::StatusCode::FAILED_PRECONDITION,
      absl::StrCat("client speaks protocol 1 (it attaches over gRPC), tsd ", kVersion,
                   " speaks protocol ", wire::kProtocolVersion,
                   " (sessions start on the side socket): upgrade the client (libtsclient / the "
                   "trainstream package) to tsd ",
                   kVersion, "'s"));
}

// A dry run of registration: the same checks (JobOptimizer::Plan, against the same pool), nothing
// allocated, no session needed.
grpc::Status TsdService::PlanOptimizer(grpc::ServerContext*,
                                       const v1::RegisterOptimizerRequest* req,
                                       v1::PlanOptimizerResponse* resp) {
  const RegistryOptions options = registry_.options();
  if (options.pool == nullptr) {
    return wire::ToGrpc(absl::InternalError("this daemon runs without an optimizer engine"));
  }
  auto plan = JobOptimizer::Plan(*req, options.pool_bytes);
  if (!plan.ok()) return wire::ToGrpc(plan.status());
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
  resp->set_params_in_master(plan->params_in_master);
  return grpc::Status::OK;
}

// The node's totals only: gRPC over a Unix socket cannot tell who calls, and a store is described
// only to the uids that proved read access to its files (the side request list_stores).
grpc::Status TsdService::ListStores(grpc::ServerContext*, const v1::ListStoresRequest*,
                                    v1::ListStoresResponse* resp) {
  if (stores_ == nullptr) return grpc::Status::OK;
  const stores::StoreTotals totals = stores_->Totals();
  resp->set_budget_bytes(totals.budget_bytes);
  resp->set_used_bytes(totals.bytes);
  resp->set_store_count(totals.stores);
  return grpc::Status::OK;
}

}  // namespace tsd
