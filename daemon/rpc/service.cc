#include "daemon/rpc/service.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "daemon/ops/version.h"
#include "proto/status_convert.h"
#include "proto/wire.h"

namespace tsd {

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

}  // namespace tsd
