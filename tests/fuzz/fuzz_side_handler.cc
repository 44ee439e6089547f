// Fuzzes the daemon's side of a session in-process: the input is cut into datagrams (frames.h:
// each prefixed by a 2-byte length), put together by the daemon's SideAssembler and served by
// SideHandler against a real Registry (memfd regions, the optimizer registrar), as one side
// connection of uid 1000 would be. A request that closes the connection ends its session, as the
// side server does. Every refusal must say why; nothing may crash, leak (descriptors included) or
// read out of bounds; and the pool's books must balance once the session is gone.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "daemon/jobs/registry.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/side_handler.h"
#include "frames.h"
#include "proto/side_message.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace {

tsd::WorkerPool& Pool() {
  static auto* pool = new tsd::WorkerPool(1, false);
  return *pool;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tsd::RegistryOptions options;
  options.pool_bytes = 8 << 20;
  options.max_job_quota_bytes = 8 << 20;
  options.max_regions_per_job = options.max_regions_per_uid = options.max_regions = 64;
  options.pool = &Pool();
  tsd::Registry registry(options);
  tsd::SideHandler handler(registry);
  tsd::SideCaller caller{.uid = 1000, .pid = 4242, .session_id = 0};
  tsd::wire::SideAssembler<tsd::v1::SideRequest> assembler{tsd::wire::kMaxSideRequestBytes};
  tsd::fuzz::ForEachFrame(data, size, [&](std::string_view frame) {
    tsd::wire::Datagram d;
    d.bytes.assign(frame);
    uint64_t id = 0;
    auto whole = assembler.Feed(std::move(d), &id);
    if (!whole.ok()) {
      if (whole.status().message().empty()) std::abort();
      return;
    }
    if (!*whole) return;
    const tsd::v1::SideRequest& request = assembler.message();
    // A state request gets a descriptor, as a trainer's would: an empty memfd.
    int fd = -1;
    if (request.has_save_state() || request.has_load_state()) {
      fd = memfd_create("fuzz-state", MFD_CLOEXEC);
    }
    tsd::SideOutcome out = handler.Handle(caller, request, fd);
    if (out.reply.code() != 0 && out.reply.message().empty()) std::abort();
    if (out.fd >= 0) close(out.fd);
    if (out.bound_session != 0) caller.session_id = out.bound_session;
    if (out.close) {
      if (caller.session_id != 0) registry.SessionDisconnected(caller.session_id);
      caller.session_id = 0;
      assembler.Reset();
    }
  });
  if (caller.session_id != 0) registry.SessionDisconnected(caller.session_id);
  if (registry.Snapshot().used_bytes != 0) std::abort();  // the books balance
  return 0;
}
