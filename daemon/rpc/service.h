// TsdService implements the gRPC control plane (tsd.v1.Tsd): the calls that need no session (the
// pool's status, the list of jobs). gRPC over a Unix socket cannot tell who calls, so every call
// of a session travels on the side socket instead (daemon/rpc/side_server.h). It is glue only:
// it calls the Registry and maps absl::Status to gRPC status codes.
//
// Every method is registered raw (bytes in, bytes out) and parses its request itself: gRPC's own
// parsing answers a malformed request with INTERNAL and an empty message, where a client should
// hear INVALID_ARGUMENT and what failed to parse, where.
#pragma once

#include <string>

#include "absl/time/time.h"
#include "daemon/jobs/registry.h"
#include "daemon/stores/store_manager.h"
#include "proto/tsd.grpc.pb.h"

namespace tsd {

using TsdServiceBase = v1::Tsd::WithRawCallbackMethod_Status<
    v1::Tsd::WithRawCallbackMethod_ListJobs<v1::Tsd::WithRawCallbackMethod_PlanOptimizer<
        v1::Tsd::WithRawCallbackMethod_Attach<
            v1::Tsd::WithRawCallbackMethod_ListStores<v1::Tsd::Service>>>>>;

class TsdService final : public TsdServiceBase {
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
  // The raw entry points: parse, call the typed method above, serialise.
  grpc::ServerUnaryReactor* Status(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                     grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* PlanOptimizer(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListStores(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  // The complete stores: metadata only (mapping one needs its files' descriptors).
  grpc::Status ListStores(grpc::ServerContext*, const v1::ListStoresRequest*,
                          v1::ListStoresResponse*) override;

 private:
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* Raw(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                grpc::ByteBuffer* resp, const char* method,
                                grpc::Status (TsdService::*typed)(grpc::ServerContext*, const Req*,
                                                                  Resp*));

  Registry& registry_;
  const bool locked_;
  stores::StoreManager* const stores_;
  const absl::Time started_ = absl::Now();
};

}  // namespace tsd
