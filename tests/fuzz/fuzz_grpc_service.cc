// Fuzzes every request handler of the gRPC control plane (TsdService, daemon/rpc/service.h)
// in-process, through the raw entry points the server calls with the request's bytes. The input is
// cut into frames (frames.h); each frame's first byte picks the method (Status, ListJobs,
// PlanOptimizer, the retired Attach, ListStores) and how many slices the request arrives in, and
// the rest is the request. The service runs against a real Registry (memfd regions, the optimizer
// engine's pool, a ledger shared with a real StoreManager) holding two jobs, so ListJobs and
// Status have something to report. Every call must finish its reactor; a refusal must say why
// (a request that does not parse is INVALID_ARGUMENT, naming the type); an answer must parse as
// the method's response type; nothing may crash, leak or read out of bounds, and the books must
// be the same after each call (the control plane changes nothing).
#include <grpc/grpc.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/test/default_reactor_test_peer.h>

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>
#include <vector>

#include "daemon/jobs/registry.h"
#include "daemon/memory/ledger.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/service.h"
#include "daemon/rpc/side_handler.h"
#include "daemon/stores/store_manager.h"
#include "frames.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace {

// The daemon's pieces, built once: the handlers under test only read them.
struct World {
  tsd::WorkerPool pool{1, false};
  tsd::Ledger ledger{32 << 20, 8 << 20};
  tsd::stores::StoreManager stores{ledger, {}};
  std::unique_ptr<tsd::Registry> registry;
  std::unique_ptr<tsd::TsdService> service;

  World() {
    tsd::RegistryOptions options;
    options.pool_bytes = 32 << 20;
    options.max_job_quota_bytes = 16 << 20;
    options.pool = &pool;
    options.ledger = &ledger;
    registry = std::make_unique<tsd::Registry>(options);
    // Two jobs of two uids, one with a region.
    tsd::SideHandler handler(*registry);
    for (uint32_t uid : {1000u, 1001u}) {
      tsd::SideCaller caller{.uid = uid, .pid = 4242, .session_id = 0};
      tsd::v1::SideRequest req;
      req.set_request_id(1);
      req.mutable_attach()->set_job("job-" + std::to_string(uid));
      req.mutable_attach()->set_protocol_version(tsd::wire::kProtocolVersion);
      caller.session_id = handler.Handle(caller, req, -1).bound_session;
      if (caller.session_id == 0) std::abort();
      req.Clear();
      req.set_request_id(2);
      req.mutable_alloc()->set_name("weights");
      req.mutable_alloc()->set_size_bytes(uid * 64);
      tsd::SideOutcome out = handler.Handle(caller, req, -1);
      if (out.reply.code() != 0) std::abort();
      if (out.fd >= 0) close(out.fd);
    }
    service = std::make_unique<tsd::TsdService>(*registry, false, &stores);
  }
};

World& TheWorld() {
  static auto* world = new World;
  return *world;
}

using RawMethod = grpc::ServerUnaryReactor* (tsd::TsdService::*)(grpc::CallbackServerContext*,
                                                                 const grpc::ByteBuffer*,
                                                                 grpc::ByteBuffer*);

template <typename Resp>
bool Parses(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return false;
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  Resp response;
  return response.ParseFromString(bytes);
}

struct Method {
  RawMethod raw;
  const char* request_type;
  bool (*response_parses)(const grpc::ByteBuffer&);
};

const Method kMethods[] = {
    {&tsd::TsdService::Status, "tsd.v1.StatusRequest", &Parses<tsd::v1::StatusResponse>},
    {&tsd::TsdService::ListJobs, "tsd.v1.ListJobsRequest", &Parses<tsd::v1::ListJobsResponse>},
    {&tsd::TsdService::PlanOptimizer, "tsd.v1.RegisterOptimizerRequest",
     &Parses<tsd::v1::PlanOptimizerResponse>},
    {&tsd::TsdService::Attach, "tsd.v1.RetiredRequest", &Parses<tsd::v1::RetiredResponse>},
    {&tsd::TsdService::ListStores, "tsd.v1.ListStoresRequest",
     &Parses<tsd::v1::ListStoresResponse>},
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  grpc_init();
  TheWorld();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  World& w = TheWorld();
  const tsd::PoolSnapshot books = w.registry->Snapshot();
  tsd::fuzz::ForEachFrame(data, size, [&](std::string_view frame) {
    if (frame.empty()) return;
    const uint8_t selector = static_cast<uint8_t>(frame[0]);
    const Method& m = kMethods[selector % std::size(kMethods)];
    const std::string_view body = frame.substr(1);
    // The request in 1 to 4 slices (gRPC may hand a message over in pieces).
    const size_t pieces = 1 + (selector >> 4) % 4;
    std::vector<grpc::Slice> slices;
    for (size_t i = 0; i < pieces; ++i) {
      const size_t begin = body.size() * i / pieces, end = body.size() * (i + 1) / pieces;
      slices.emplace_back(body.data() + begin, end - begin);
    }
    grpc::ByteBuffer request(slices.data(), slices.size()), response;
    grpc::CallbackServerContext ctx;
    grpc::testing::DefaultReactorTestPeer peer(&ctx);
    (w.service.get()->*m.raw)(&ctx, (selector & 0x80) ? nullptr : &request, &response);
    if (!peer.test_status_set()) std::abort();  // the call must finish
    const grpc::Status s = peer.test_status();
    if (!s.ok()) {
      if (s.error_message().empty()) std::abort();  // refusals say why
      if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
          s.error_message().find(m.request_type) == std::string::npos &&
          s.error_message().rfind("the ", 0) == 0 &&
          s.error_message().find("is not a valid") != std::string::npos) {
        std::abort();  // a parse failure names the type
      }
    } else if (!m.response_parses(response)) {
      std::abort();
    }
  });
  const tsd::PoolSnapshot after = w.registry->Snapshot();
  if (after.used_bytes != books.used_bytes || after.jobs != books.jobs ||
      after.sessions != books.sessions) {
    std::abort();  // the control plane changes nothing
  }
  return 0;
}
