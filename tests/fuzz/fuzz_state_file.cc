// Fuzzes the optimizer-state reader: a job with a small optimizer (two buckets, one group) is set
// up once in-process through SideHandler, as a trainer would; each input is written into a memfd
// and handed to a load_state request, which parses it as a safetensors state file
// (daemon/optimizer/job_optimizer_state.cc). A file that is refused must be refused with a
// message; nothing may crash or read out of bounds.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "daemon/jobs/registry.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/side_handler.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace {

struct Job {
  tsd::WorkerPool pool{1, false};
  tsd::Registry registry{[this] {
    tsd::RegistryOptions o;
    o.pool_bytes = 16 << 20;
    o.max_job_quota_bytes = 16 << 20;
    o.pool = &pool;
    return o;
  }()};
  tsd::SideHandler handler{registry};
  tsd::SideCaller caller{.uid = 1000, .pid = 4242, .session_id = 0};

  Job() {
    tsd::v1::SideRequest attach;
    attach.set_request_id(1);
    attach.mutable_attach()->set_job("fuzz");
    attach.mutable_attach()->set_protocol_version(tsd::wire::kProtocolVersion);
    caller.session_id = handler.Handle(caller, attach, -1).bound_session;
    tsd::v1::SideRequest reg;
    reg.set_request_id(2);
    auto* r = reg.mutable_register_optimizer();
    auto* g = r->add_groups();
    g->set_lr(1e-3);
    g->set_beta1(0.9);
    g->set_beta2(0.999);
    g->set_eps(1e-8);
    for (uint64_t n : {3, 5}) {
      auto* b = r->add_buckets();
      b->set_numel(n);
      b->set_grad_dtype(tsd::v1::F32);
      b->set_param_dtype(tsd::v1::F32);
    }
    const tsd::SideOutcome out = handler.Handle(caller, reg, -1);
    if (caller.session_id == 0 || out.reply.code() != 0) std::abort();
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Job* job = new Job;
  const int fd = memfd_create("fuzz-state", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (size_t at = 0; at < size;) {
    const ssize_t n = write(fd, data + at, size - at);
    if (n <= 0) break;
    at += static_cast<size_t>(n);
  }
  tsd::v1::SideRequest load;
  load.set_request_id(3);
  load.mutable_load_state();
  const tsd::SideOutcome out = job->handler.Handle(job->caller, load, fd);  // takes fd
  if (out.reply.code() != 0 && out.reply.message().empty()) std::abort();
  if (out.close) std::abort();  // a bad file never ends the session
  return 0;
}
