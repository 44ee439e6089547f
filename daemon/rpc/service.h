// TsdService implements the gRPC control plane (tsd.v1.Tsd): the calls that need no session (the
// pool's status, the list of jobs). gRPC over a Unix socket cannot tell who calls, so every call
// of a session travels on the side socket instead (daemon/rpc/side_server.h). It is glue only:
// it calls the Registry and maps absl::Status to gRPC status codes.
#pragma once

#include <string>

#include "absl/time/time.h"
#include "daemon/jobs/registry.h"
#include "daemon/stores/store_manager.h"
#include "proto/tsd.grpc.pb.h"

namespace tsd {

class TsdService final : public v1::Tsd::Service {
 public:
  // `stores` may be null (ListStores then lists none).
  TsdService(Registry& registry, bool locked, stores::StoreManager* stores = nullptr)
      : registry_(registry), locked_(locked), stores_(stores) {}

  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*, v1::StatusResponse*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status PlanOptimizer(grpc::ServerContext*, const v1::RegisterOptimizerRequest*,
                             v1::PlanOptimizerResponse*) override;
  // Retired with protocol 1: tells such a client to upgrade.
  grpc::Status Attach(grpc::ServerContext*, const v1::RetiredRequest*,
                      v1::RetiredResponse*) override;
  // The complete stores: metadata only (mapping one needs its files' descriptors).
  grpc::Status ListStores(grpc::ServerContext*, const v1::ListStoresRequest*,
                          v1::ListStoresResponse*) override;

 private:
  Registry& registry_;
  const bool locked_;
  stores::StoreManager* const stores_;
  const absl::Time started_ = absl::Now();
};

}  // namespace tsd
