// Writes the seed inputs of the fuzz targets (tests/fuzz/corpus/<target>/seed-*): valid side
// conversations framed as the targets read them, a valid optimizer state file saved by the same
// small optimizer fuzz_state_file loads into, and safetensors checkpoints for fuzz_safetensors.
// Run by scripts/fuzz.sh --seed; the seeds are kept in the repository, so this is only needed
// when the protocol changes.
//   make_seeds CORPUS_DIR
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "daemon/jobs/registry.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/side_handler.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace {

using tsd::v1::SideRequest;

// One datagram as the targets read it: a 2-byte little-endian length, then the bytes.
std::string Frame(const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(bytes.size() & 0xff));
  out.push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
  return out + bytes;
}

std::string Frame(const SideRequest& r) { return Frame(r.SerializeAsString()); }

void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

SideRequest Attach(uint64_t id) {
  SideRequest r;
  r.set_request_id(id);
  r.mutable_attach()->set_job("fuzz");
  r.mutable_attach()->set_protocol_version(tsd::wire::kProtocolVersion);
  return r;
}

SideRequest Register(uint64_t id, std::vector<uint64_t> sizes) {
  SideRequest r;
  r.set_request_id(id);
  auto* reg = r.mutable_register_optimizer();
  auto* g = reg->add_groups();
  g->set_lr(1e-3);
  g->set_beta1(0.9);
  g->set_beta2(0.999);
  g->set_eps(1e-8);
  for (uint64_t n : sizes) {
    auto* b = reg->add_buckets();
    b->set_numel(n);
    b->set_grad_dtype(tsd::v1::F32);
    b->set_param_dtype(tsd::v1::F32);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
    return 2;
  }
  spdlog::set_level(spdlog::level::off);
  const std::string root = argv[1];
  // A whole session: attach, alloc, list, get_fd, free, register, save, load, retire, detach.
  std::string session = Frame(Attach(1));
  SideRequest r;
  r.set_request_id(2);
  r.mutable_alloc()->set_name("grads");
  r.mutable_alloc()->set_size_bytes(4096);
  session += Frame(r);
  r.Clear();
  r.set_request_id(3);
  r.mutable_list_regions();
  session += Frame(r);
  r.Clear();
  r.set_request_id(4);
  r.mutable_get_fd()->set_region_id(1);
  session += Frame(r);
  r.Clear();
  r.set_request_id(5);
  r.mutable_free()->set_region_id(1);
  session += Frame(r);
  session += Frame(Register(6, {3, 5}));
  r.Clear();
  r.set_request_id(7);
  r.mutable_save_state();
  session += Frame(r);
  r.Clear();
  r.set_request_id(8);
  r.mutable_load_state();
  session += Frame(r);
  r.Clear();
  r.set_request_id(9);
  r.mutable_retire_buckets()->add_buckets(1);
  session += Frame(r);
  r.Clear();
  r.set_request_id(10);
  r.mutable_detach();
  session += Frame(r);
  Write(root + "/fuzz_side_handler", "seed-session", session);
  Write(root + "/fuzz_side_message", "seed-session", session);
  // list_stores: on a connection of its own (it closes), then in a session.
  r.Clear();
  r.set_request_id(1);
  r.mutable_list_stores();
  std::string listing = Frame(r) + Frame(Attach(1));
  r.set_request_id(2);
  listing += Frame(r);
  Write(root + "/fuzz_side_handler", "seed-list-stores", listing);
  Write(root + "/fuzz_side_message", "seed-list-stores", listing);
  // A registration in two fragments.
  const std::string whole = Register(2, {1, 2, 3, 4}).SerializeAsString();
  SideRequest f1, f2;
  f1.set_request_id(2);
  f1.set_fragment(whole.substr(0, whole.size() / 2));
  f1.set_more_fragments(true);
  f2.set_request_id(2);
  f2.set_fragment(whole.substr(whole.size() / 2));
  const std::string fragments = Frame(Attach(1)) + Frame(f1) + Frame(f2);
  Write(root + "/fuzz_side_handler", "seed-fragments", fragments);
  Write(root + "/fuzz_side_message", "seed-fragments", fragments);

  // fuzz_grpc_service: each method once with a valid request (a frame: the selector byte, then
  // the request), and a registration plan in three slices.
  const std::string plan = Register(0, {3, 5, 1 << 20}).register_optimizer().SerializeAsString();
  std::string calls;
  for (const std::string& call :
       {std::string("\x00", 1) + tsd::v1::StatusRequest().SerializeAsString(),
        std::string("\x01") + tsd::v1::ListJobsRequest().SerializeAsString(), "\x02" + plan,
        std::string("\x03") + tsd::v1::RetiredRequest().SerializeAsString(),
        std::string("\x04") + tsd::v1::ListStoresRequest().SerializeAsString(), "\x20" + plan}) {
    calls += Frame(call);
  }
  Write(root + "/fuzz_grpc_service", "seed-calls", calls);

  // A valid state file of fuzz_state_file's optimizer (buckets of 3 and 5, one group).
  tsd::WorkerPool pool(1, false);
  tsd::RegistryOptions o;
  o.pool_bytes = o.max_job_quota_bytes = 16 << 20;
  o.pool = &pool;
  tsd::Registry registry(o);
  tsd::SideHandler handler(registry);
  tsd::SideCaller caller{.uid = 1000, .pid = 1, .session_id = 0};
  caller.session_id = handler.Handle(caller, Attach(1), -1).bound_session;
  if (handler.Handle(caller, Register(2, {3, 5}), -1).reply.code() != 0) return 1;
  const int fd = memfd_create("state", 0);
  r.Clear();
  r.set_request_id(3);
  r.mutable_save_state();
  const tsd::SideOutcome saved = handler.Handle(caller, r, dup(fd));
  if (saved.reply.code() != 0) {
    std::fprintf(stderr, "save_state: %s\n", saved.reply.message().c_str());
    return 1;
  }
  std::string state(static_cast<size_t>(lseek(fd, 0, SEEK_END)), '\0');
  if (pread(fd, state.data(), state.size(), 0) != static_cast<ssize_t>(state.size())) return 1;
  Write(root + "/fuzz_state_file", "seed-state", state);

  // fuzz_safetensors: a valid checkpoint of three tensors (F32, BF16, a scalar I8), with
  // __metadata__ and a key tsd skips, then the data; and one whose header is cut short.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16],"extra":{"k":[1,2.5,{"z":null}]}},)"
      R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
      R"("c":{"dtype":"I8","shape":[],"data_offsets":[22,23]}})";
  const auto checkpoint = [](const std::string& json, uint64_t len) {
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((len >> (8 * i)) & 0xff);
    return file + json + std::string(23, '\x01');
  };
  Write(root + "/fuzz_safetensors", "seed-checkpoint", checkpoint(header, header.size()));
  Write(root + "/fuzz_safetensors", "seed-cut-header",
        checkpoint(header.substr(0, header.size() / 2), header.size() / 2));
  return 0;
}
