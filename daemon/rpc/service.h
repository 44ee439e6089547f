// TsdService implements the gRPC control plane (tsd.v1.Tsd). It is glue only: it unpacks
// requests, calls the Registry and maps absl::Status to gRPC status codes.
#pragma once

#include <string>

#include "absl/time/time.h"
#include "daemon/jobs/registry.h"
#include "proto/tsd.grpc.pb.h"

namespace tsd {

class TsdService final : public v1::Tsd::Service {
 public:
  TsdService(Registry& registry, std::string side_socket, bool locked)
      : registry_(registry), side_socket_(std::move(side_socket)), locked_(locked) {}

  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::AttachResponse*) override;
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest*, v1::DetachResponse*) override;
  grpc::Status Alloc(grpc::ServerContext*, const v1::AllocRequest*, v1::AllocResponse*) override;
  grpc::Status Free(grpc::ServerContext*, const v1::FreeRequest*, v1::FreeResponse*) override;
  grpc::Status ListRegions(grpc::ServerContext*, const v1::ListRegionsRequest*,
                           v1::ListRegionsResponse*) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status RegisterOptimizer(grpc::ServerContext*, const v1::RegisterOptimizerRequest*,
                                 v1::RegisterOptimizerResponse*) override;
  grpc::Status PlanOptimizer(grpc::ServerContext*, const v1::RegisterOptimizerRequest*,
                             v1::PlanOptimizerResponse*) override;

 private:
  Registry& registry_;
  const std::string side_socket_;
  const bool locked_;
  const absl::Time started_ = absl::Now();
};

}  // namespace tsd
