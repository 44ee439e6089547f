// Weight stores end to end, against a real tsd: tsd builds a store itself from checkpoint files a
// job sends as descriptors; two jobs map one copy (one charge, two users); concurrent loads build
// once; a client killed mid-build leaves a complete store or none; unused stores are kept for
// store_keep and evicted oldest first when the budget is short, stores in use never; a store is
// reached only by presenting readable descriptors of its files; client mappings are read-only
// (a write faults); malformed or lying checkpoints are refused with a message naming the file and
// the tensor, and change nothing.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "kernels/cpu/quant_format.h"
#include "nlohmann/json.hpp"
#include "proto/tsd.grpc.pb.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

struct TensorData {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

// Writes a safetensors file: 8-byte little-endian header length, the JSON header, the data.
// `header` replaces the generated header when not empty (to write malformed files).
void WriteSafetensors(const std::string& path, const std::vector<TensorData>& tensors,
                      const std::string& header = "", int64_t length_override = -1) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t at = 0;
  std::string data;
  for (const TensorData& t : tensors) {
    h[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {at, at + t.bytes.size()}}};
    at += t.bytes.size();
    data += t.bytes;
  }
  h["__metadata__"] = {{"format", "pt"}};
  const std::string json = header.empty() ? h.dump() : header;
  uint64_t len = length_override >= 0 ? static_cast<uint64_t>(length_override) : json.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << out << json << data;
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> RandomFloats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A small checkpoint: an F32 matrix to quantize, a BF16 vector and I64 ids kept as stored.
struct Checkpoint {
  std::string path;
  std::vector<float> w;
  std::string b, ids;
};

Checkpoint MakeCheckpoint(const std::string& path, size_t rows = 64, size_t cols = 64,
                          uint32_t seed = 1) {
  Checkpoint c;
  c.path = path;
  c.w = RandomFloats(rows * cols, seed);
  c.b.resize(2 * 128);
  for (size_t i = 0; i < c.b.size(); ++i) c.b[i] = static_cast<char>(i * 7 + seed);
  c.ids.resize(8 * 4);
  for (size_t i = 0; i < c.ids.size(); ++i) c.ids[i] = static_cast<char>(i);
  WriteSafetensors(path, {{"model.w", "F32", {rows, cols}, Floats(c.w)},
                          {"model.b", "BF16", {128}, c.b},
                          {"model.ids", "I64", {4}, c.ids}});
  return c;
}

StoreSpec Nf4Spec() {
  return StoreSpec{.format = "nf4",
                   .block_size = 64,
                   .tensors = {{"model.w", true}, {"model.b", false}, {"model.ids", false}}};
}

std::unique_ptr<tsd::Client> Attached(const DaemonProcess& d, const std::string& job) {
  auto c = d.Connect();
  EXPECT_TRUE(c->Attach(job).ok());
  return c;
}

uint64_t StoreBytes(tsd::Client& c) {
  auto stores = c.Stores();
  EXPECT_TRUE(stores.ok()) << stores.status();
  uint64_t sum = 0;
  for (const auto& s : *stores) sum += s.bytes;
  return sum;
}

TEST(Stores, TwoJobsMapOneStoreWithOneChargeAndTwoUsers) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/model.safetensors");
  auto a = Attached(*d, "job-a"), b = Attached(*d, "job-b");

  auto va = a->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(va.ok()) << va.status();
  EXPECT_TRUE((*va)->built());
  auto vb = b->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(vb.ok()) << vb.status();
  EXPECT_FALSE((*vb)->built()) << "the second job must find the store, not build it";
  EXPECT_EQ((*va)->id(), (*vb)->id());

  auto stores = a->Stores();
  ASSERT_TRUE(stores.ok());
  ASSERT_EQ(stores->size(), 1u);
  EXPECT_EQ((*stores)[0].users, 2u);
  EXPECT_EQ((*stores)[0].format, "nf4");
  EXPECT_EQ((*stores)[0].source, ck.path);
  EXPECT_THAT((*stores)[0].digest, HasSubstr("xxh3-64:"));
  // One charge, to the pool, none to either job.
  auto status = a->Status();
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->used_bytes, (*stores)[0].bytes);
  const auto jobs = a->Jobs();
  ASSERT_TRUE(jobs.ok());
  for (const auto& j : *jobs) EXPECT_EQ(j.used_bytes, 0u) << j.name;

  // The contents: kept tensors byte for byte, the quantized one as NF4 codes and absmax.
  const StoreView& v = **vb;
  const StoreTensorView* bt = v.Find("model.b");
  ASSERT_NE(bt, nullptr);
  EXPECT_FALSE(bt->quantized);
  EXPECT_EQ(bt->dtype, "BF16");
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(v.data() + bt->offset), bt->bytes), ck.b);
  const StoreTensorView* ids = v.Find("model.ids");
  ASSERT_NE(ids, nullptr);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(v.data() + ids->offset), ids->bytes), ck.ids);
  const StoreTensorView* w = v.Find("model.w");
  ASSERT_NE(w, nullptr);
  ASSERT_TRUE(w->quantized);
  EXPECT_EQ(w->shape, (std::vector<uint64_t>{64, 64}));
  EXPECT_EQ(w->bytes, ck.w.size() / 2);
  ASSERT_EQ(w->absmax_count, ck.w.size() / 64);
  const auto* absmax = reinterpret_cast<const float*>(v.data() + w->absmax_offset);
  for (size_t blk = 0; blk < w->absmax_count; ++blk) {
    float m = 0;
    for (size_t i = 0; i < 64; ++i) m = std::max(m, std::fabs(ck.w[blk * 64 + i]));
    ASSERT_EQ(absmax[blk], m) << "block " << blk;
    for (size_t i = 0; i < 64; ++i) {
      const size_t e = blk * 64 + i;
      const uint8_t byte = v.data()[w->offset + e / 2];
      const int code = e % 2 == 0 ? byte >> 4 : byte & 0xf;
      const float deq = kernels::detail::kNf4Values[code] * m;
      ASSERT_LE(std::fabs(deq - ck.w[e]), 0.2f * m) << "element " << e;
    }
  }

  // tsctl shows it.
  int rc = 0;
  const std::string out =
      RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() + " stores --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto listed = nlohmann::json::parse(out);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0]["users"], 2);
  EXPECT_EQ(listed[0]["id"], (*va)->id());
  // The control socket cannot tell who calls: its ListStores gives the node's totals only.
  auto stub = v1::Tsd::NewStub(
      grpc::CreateChannel("unix:" + d->socket(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::ListStoresResponse totals;
  ASSERT_TRUE(stub->ListStores(&ctx, v1::ListStoresRequest(), &totals).ok());
  EXPECT_EQ(totals.stores_size(), 0) << "per-store detail on the control socket";
  EXPECT_EQ(totals.store_count(), 1u);
  EXPECT_EQ(totals.used_bytes(), (*stores)[0].bytes);
  EXPECT_GT(totals.budget_bytes(), 0u);
  // Unattached, the client asks on a connection of its own: the same listing, with the totals.
  auto probe = d->Connect();
  auto listing = probe->ListStores();
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->stores.size(), 1u);
  EXPECT_EQ(listing->node_stores, 1u);
  EXPECT_EQ(listing->node_bytes, (*stores)[0].bytes);
  EXPECT_EQ(listing->budget_bytes, totals.budget_bytes());
  EXPECT_EQ(listing->not_shown(), 0u);

  // One job leaves: one user left, the store stays.
  ASSERT_TRUE(a->CloseStore((*va)->id()).ok());
  EXPECT_EQ((*a->Stores())[0].users, 1u);
  EXPECT_EQ(a->CloseStore((*va)->id()).code(), absl::StatusCode::kNotFound);
}

TEST(Stores, ConcurrentLoadsBuildOnce) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "256MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/big.safetensors", 2048, 1024);  // 8 MiB
  constexpr int kJobs = 4;
  std::vector<std::unique_ptr<tsd::Client>> clients;
  for (int i = 0; i < kJobs; ++i) clients.push_back(Attached(*d, "job-" + std::to_string(i)));
  std::vector<absl::StatusOr<std::shared_ptr<StoreView>>> views(kJobs, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int i = 0; i < kJobs; ++i) {
    threads.emplace_back([&, i] { views[i] = clients[i]->OpenStore({ck.path}, Nf4Spec()); });
  }
  for (auto& t : threads) t.join();
  int built = 0;
  for (int i = 0; i < kJobs; ++i) {
    ASSERT_TRUE(views[i].ok()) << views[i].status();
    built += (*views[i])->built() ? 1 : 0;
    EXPECT_EQ((*views[i])->id(), (*views[0])->id());
  }
  EXPECT_EQ(built, 1);
  auto stores = clients[0]->Stores();
  ASSERT_EQ(stores->size(), 1u);
  EXPECT_EQ((*stores)[0].users, static_cast<uint32_t>(kJobs));
  EXPECT_EQ(clients[0]->Status()->used_bytes, (*stores)[0].bytes);
}

TEST(Stores, AClientKilledMidBuildLeavesACompleteStoreOrNoneAndTheNextLoadCompletes) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/big.safetensors", 4096, 4096);  // 64 MiB
  for (int delay_ms : {0, 5, 40}) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      // The child speaks the side protocol by hand (no gRPC crosses the fork).
      RawSession s(d->socket());
      const int fd = open(ck.path.c_str(), O_RDONLY);
      if (fd < 0 || s.Attach("killed").code() != 0) _exit(2);
      v1::SideRequest file;
      file.mutable_store_file();
      if (s.Request(file, nullptr, nullptr, fd).code() != 0) _exit(3);
      v1::SideRequest open_req;
      open_req.mutable_open_store()->set_format("int8");
      open_req.mutable_open_store()->add_tensors()->set_name("model.w");
      open_req.mutable_open_store()->mutable_tensors(0)->set_quantize(true);
      s.Request(open_req);
      _exit(0);
    }
    usleep(delay_ms * 1000 + 2000);
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    auto c = Attached(*d, "next-" + std::to_string(delay_ms));
    // Whatever tsd has, once a build in flight has ended, is complete: every listed store is
    // charged, and nothing else is.
    EXPECT_TRUE(WaitFor([&] { return c->Status()->used_bytes == StoreBytes(*c); }, 30));
    StoreSpec spec{.format = "int8", .block_size = 64, .tensors = {{"model.w", true}}};
    auto v = c->OpenStore({ck.path}, spec);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(c->Stores()->size(), 1u);
    EXPECT_EQ(c->Status()->used_bytes, (*v)->size());
    // A complete store: the last block's absmax is the data's.
    const StoreTensorView* w = (*v)->Find("model.w");
    ASSERT_NE(w, nullptr);
    const auto* absmax = reinterpret_cast<const float*>((*v)->data() + w->absmax_offset);
    float m = 0;
    for (size_t i = ck.w.size() - 64; i < ck.w.size(); ++i) m = std::max(m, std::fabs(ck.w[i]));
    EXPECT_EQ(absmax[w->absmax_count - 1], m);
    ASSERT_TRUE(c->Detach().ok());
  }
}

TEST(Stores, EvictionTakesOnlyUnusedStoresOldestFirst) {
  // Each store holds a 3 MiB tensor as stored; the budget holds three.
  auto d = DaemonProcess::Start(
      {.args = {"--pool-size", "64MiB", "--store-budget", "10MiB", "--store-keep", "10m"}});
  ASSERT_TRUE(d);
  std::vector<std::string> paths;
  for (int i = 0; i < 6; ++i) {
    paths.push_back(d->dir() + "/m" + std::to_string(i) + ".safetensors");
    WriteSafetensors(paths.back(),
                     {{"w", "F32", {768, 1024}, Floats(RandomFloats(768 * 1024, i))}});
  }
  auto c = Attached(*d, "job");
  const StoreSpec as_stored;
  std::vector<uint64_t> id;
  auto open = [&](int i) -> std::shared_ptr<StoreView> {
    auto v = c->OpenStore({paths[i]}, as_stored);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return nullptr;
    if (id.size() <= static_cast<size_t>(i)) id.resize(i + 1);
    id[i] = (*v)->id();
    return *v;
  };
  auto listed = [&] {
    std::vector<uint64_t> ids;
    const auto stores = c->Stores();
    EXPECT_TRUE(stores.ok()) << stores.status();
    for (const auto& s : *stores) ids.push_back(s.id);
    return ids;
  };
  auto s0 = open(0);  // in use throughout
  auto s1 = open(1);
  ASSERT_TRUE(c->CloseStore(id[1]).ok());  // unused, the older
  usleep(20000);
  auto s2 = open(2);
  ASSERT_TRUE(c->CloseStore(id[2]).ok());  // unused, the newer
  ASSERT_EQ(listed().size(), 3u);
  auto s3 = open(3);  // needs one store's room: the oldest unused (1) goes
  EXPECT_EQ(listed(), (std::vector<uint64_t>{id[0], id[2], id[3]}));
  auto s4 = open(4);  // then the next oldest unused (2)
  EXPECT_EQ(listed(), (std::vector<uint64_t>{id[0], id[3], id[4]}));
  // Every store is in use now: a sixth is refused, naming the budget, and nothing is evicted.
  auto refused = c->OpenStore({paths[5]}, as_stored);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("store budget"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("every store is in use"));
  EXPECT_EQ(listed(), (std::vector<uint64_t>{id[0], id[3], id[4]}));
  // A region that does not fit the pool evicts an unused store to make room.
  ASSERT_TRUE(c->CloseStore(id[3]).ok());
  const uint64_t free_before = c->Status()->pool_bytes - c->Status()->used_bytes;
  auto region = c->Alloc("big", free_before + (1 << 20));
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(listed(), (std::vector<uint64_t>{id[0], id[4]}));
}

TEST(Stores, AnUnusedStoreIsKeptForStoreKeepThenDropped) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB", "--store-keep", "1500ms"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/model.safetensors");
  auto c = Attached(*d, "job");
  auto v = c->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(v.ok()) << v.status();
  const uint64_t id = (*v)->id();
  ASSERT_TRUE(c->CloseStore(id).ok());
  const auto left = std::chrono::steady_clock::now();
  // Kept warm: a restarted job finds it without building.
  usleep(300000);
  ASSERT_EQ(c->Stores()->size(), 1u);
  EXPECT_EQ((*c->Stores())[0].users, 0u);
  EXPECT_GT((*c->Stores())[0].idle_s, 0.2);
  auto again = c->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE((*again)->built());
  EXPECT_EQ((*again)->id(), id);
  // Left again: dropped about 1.5 s later, not before.
  ASSERT_TRUE(c->Detach().ok());  // releasing the job ends its use too
  const auto released = std::chrono::steady_clock::now();
  (void)left;
  auto probe = d->Connect();
  usleep(1000000);
  EXPECT_EQ(probe->Stores()->size(), 1u) << "dropped before store_keep";
  ASSERT_TRUE(WaitFor([&] { return probe->Stores()->empty(); }, 5));
  const double after =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - released).count();
  EXPECT_GE(after, 1.4);
  EXPECT_EQ(probe->Status()->used_bytes, 0u);
}

TEST(Stores, OnlyReadableDescriptorsOfTheFilesOpenAStore) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/model.safetensors");
  auto owner = Attached(*d, "owner");
  auto v = owner->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(v.ok()) << v.status();

  RawSession s(d->socket());
  ASSERT_EQ(s.Attach("intruder").code(), 0);
  auto open_store = [&] {
    v1::SideRequest r;
    r.mutable_open_store()->set_format("nf4");
    for (const auto& t : Nf4Spec().tensors) {
      auto* w = r.mutable_open_store()->add_tensors();
      w->set_name(t.name);
      w->set_quantize(t.quantize);
    }
    int fd = -1;
    v1::SideReply reply = s.Request(r, nullptr, &fd);
    if (reply.code() != 0) {
      EXPECT_LT(fd, 0) << "a refused open_store must carry no descriptor";
    } else {
      EXPECT_GE(fd, 0) << "an open_store reply must carry the store";
    }
    if (fd >= 0) close(fd);
    return reply;
  };
  auto stage = [&](int fd) {
    v1::SideRequest r;
    r.mutable_store_file();
    return s.Request(r, nullptr, nullptr, fd);
  };
  // No descriptors at all.
  v1::SideReply none = open_store();
  EXPECT_EQ(none.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(none.message(), HasSubstr("descriptors of its checkpoint files"));
  // A store_file without a descriptor.
  v1::SideReply missing = stage(-1);
  EXPECT_EQ(missing.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  // O_PATH proves nothing.
  const int opath = open(ck.path.c_str(), O_PATH);
  ASSERT_GE(opath, 0);
  v1::SideReply path_only = stage(opath);
  close(opath);
  EXPECT_EQ(path_only.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(path_only.message(), HasSubstr("O_PATH"));
  // Write-only proves nothing either.
  const int wronly = open(ck.path.c_str(), O_WRONLY);
  ASSERT_GE(wronly, 0);
  v1::SideReply write_only = stage(wronly);
  close(wronly);
  EXPECT_EQ(write_only.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  // A pipe is no checkpoint.
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  v1::SideReply piped = stage(p[0]);
  close(p[0]);
  close(p[1]);
  EXPECT_EQ(piped.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  // The wrong file (readable, but not the checkpoint) gets no store either.
  const std::string other = d->dir() + "/notes.txt";
  std::ofstream(other) << "not a checkpoint";
  const int wrong = open(other.c_str(), O_RDONLY);
  ASSERT_EQ(stage(wrong).code(), 0);
  close(wrong);
  v1::SideReply refused = open_store();
  EXPECT_EQ(refused.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(refused.message(), HasSubstr(other));
  // Closing a store the job does not use is refused too.
  v1::SideRequest close_req;
  close_req.mutable_close_store()->set_store_id((*v)->id());
  EXPECT_EQ(s.Request(close_req).code(), static_cast<int>(absl::StatusCode::kNotFound));
  // Nothing changed for the owner's store.
  auto stores = owner->Stores();
  ASSERT_EQ(stores->size(), 1u);
  EXPECT_EQ((*stores)[0].users, 1u);
  // With a readable descriptor of the file, the intruder is simply another user.
  const int good = open(ck.path.c_str(), O_RDONLY);
  ASSERT_EQ(stage(good).code(), 0);
  close(good);
  v1::SideReply ok = open_store();
  EXPECT_EQ(ok.code(), 0) << ok.message();
  EXPECT_EQ(ok.open_store().store().store_id(), (*v)->id());
}

TEST(Stores, AWriteThroughAClientMappingFaults) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/model.safetensors");
  auto c = Attached(*d, "job");
  auto v = c->OpenStore({ck.path}, Nf4Spec());
  ASSERT_TRUE(v.ok()) << v.status();
  const StoreView& view = **v;
  // The descriptor cannot be mapped writable, made writable, resized or written.
  EXPECT_EQ(mmap(nullptr, view.size(), PROT_READ | PROT_WRITE, MAP_SHARED, view.fd(), 0),
            MAP_FAILED);
  EXPECT_NE(mprotect(const_cast<uint8_t*>(view.data()), view.size(), PROT_READ | PROT_WRITE), 0);
  EXPECT_NE(ftruncate(view.fd(), 0), 0);
  EXPECT_NE(pwrite(view.fd(), "x", 1, 0), 1);
  const int reopened = open(("/proc/self/fd/" + std::to_string(view.fd())).c_str(), O_RDWR);
  if (reopened >= 0) {  // even a read-write reopening (as root) cannot write: the memfd is sealed
    EXPECT_NE(pwrite(reopened, "x", 1, 0), 1);
    EXPECT_EQ(mmap(nullptr, view.size(), PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0),
              MAP_FAILED);
    close(reopened);
  }
  const uint8_t first = view.data()[0];
  // A forked child writing through the mapping dies of a fault.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The default action, so a sanitizer's own SIGSEGV handler does not turn the fault into an
    // abort (SIGABRT) in sanitizer builds.
    signal(SIGSEGV, SIG_DFL);
    signal(SIGBUS, SIG_DFL);
    volatile uint8_t* p = const_cast<uint8_t*>(view.data());
    p[0] = static_cast<uint8_t>(first + 1);
    _exit(0);  // reached only if the write went through
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child's write went through";
  EXPECT_TRUE(WTERMSIG(status) == SIGSEGV || WTERMSIG(status) == SIGBUS) << WTERMSIG(status);
  EXPECT_EQ(view.data()[0], first);
}

TEST(Stores, MalformedOrLyingCheckpointsAreRefusedNamingTheFileAndTensor) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  auto c = Attached(*d, "job");
  const std::string dir = d->dir();
  const std::string f32 = Floats(RandomFloats(16, 3));
  struct Case {
    std::string name;
    std::function<void(const std::string&)> write;
    StoreSpec spec;
    std::vector<std::string> expect;
  };
  const StoreSpec all;
  const std::vector<Case> cases = {
      {"header-longer-than-file",
       [&](const std::string& p) {
         WriteSafetensors(p, {{"t", "F32", {16}, f32}}, "", 1 << 20);
       },
       all,
       {"header says"}},
      {"not-json",
       [&](const std::string& p) { WriteSafetensors(p, {}, "{not json"); },
       all,
       {"not JSON"}},
      {"lying-size",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"layer.q":{"dtype":"F32","shape":[4,4],"data_offsets":[0,60]}})");
         std::ofstream(p, std::ios::app) << std::string(64, 'x');
       },
       all,
       {"tensor 'layer.q'", "spans 60 bytes", "need 64"}},
      {"past-the-end",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"layer.k":{"dtype":"F32","shape":[16],"data_offsets":[0,64]}})");
         std::ofstream(p, std::ios::app) << std::string(10, 'x');
       },
       all,
       {"tensor 'layer.k'", "truncated or the header lies"}},
      {"overlap",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})");
         std::ofstream(p, std::ios::app) << std::string(24, 'x');
       },
       all,
       {"'a' and 'b' overlap"}},
      {"unknown-dtype",
       [&](const std::string& p) {
         WriteSafetensors(p, {}, R"({"odd":{"dtype":"Q7","shape":[4],"data_offsets":[0,4]}})");
         std::ofstream(p, std::ios::app) << std::string(4, 'x');
       },
       all,
       {"tensor 'odd'", "unknown dtype 'Q7'"}},
      {"negative-shape",
       [&](const std::string& p) {
         WriteSafetensors(p, {}, R"({"neg":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})");
         std::ofstream(p, std::ios::app) << std::string(16, 'x');
       },
       all,
       {"tensor 'neg'", "shape"}},
      {"nested-too-deep",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"deep":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"x":)" +
                              std::string(100, '[') + std::string(100, ']') + "}}");
         std::ofstream(p, std::ios::app) << std::string(16, 'x');
       },
       all,
       {"tensor 'deep'", "nested deeper than 16"}},
      {"metadata-not-strings",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"__metadata__":{"format":["pt"]},)"
                          R"("t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})");
         std::ofstream(p, std::ios::app) << std::string(16, 'x');
       },
       all,
       {"__metadata__", "not a string"}},
      {"named-twice",
       [&](const std::string& p) {
         WriteSafetensors(p, {},
                          R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                          R"("t":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})");
         std::ofstream(p, std::ios::app) << std::string(32, 'x');
       },
       all,
       {"tensor 't' is named twice"}},
      {"cut-off-json",
       [&](const std::string& p) {
         WriteSafetensors(p, {}, R"({"t":{"dtype":"F32","shape":[4],"data_off)");
       },
       all,
       {"not JSON", "breaks off at byte"}},
      {"missing-tensor",
       [&](const std::string& p) {
         WriteSafetensors(p, {{"t", "F32", {16}, f32}});
       },
       StoreSpec{.format = "nf4", .tensors = {{"nope", true}}},
       {"tensor 'nope' is in none"}},
      {"quantize-ints",
       [&](const std::string& p) {
         WriteSafetensors(p, {{"ids", "I64", {2}, std::string(16, 'i')}});
       },
       StoreSpec{.format = "int8", .tensors = {{"ids", true}}},
       {"tensor 'ids'", "I64", "only F32, BF16 and F16"}},
      {"non-finite",
       [&](const std::string& p) {
         std::vector<float> v(16, 1.0f);
         v[5] = INFINITY;
         WriteSafetensors(p, {{"inf", "F32", {16}, Floats(v)}});
       },
       StoreSpec{.format = "nf4", .tensors = {{"inf", true}}},
       {"tensor 'inf' cannot be quantized", "Inf"}},
      {"odd-nf4-block",
       [&](const std::string& p) {
         WriteSafetensors(p, {{"t", "F32", {16}, f32}});
       },
       StoreSpec{.format = "nf4", .block_size = 3, .tensors = {{"t", true}}},
       {"tensor 't'", "block"}},
  };
  for (const Case& k : cases) {
    const std::string path = dir + "/" + k.name + ".safetensors";
    k.write(path);
    auto v = c->OpenStore({path}, k.spec);
    ASSERT_FALSE(v.ok()) << k.name;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << k.name;
    const std::string msg(v.status().message());
    EXPECT_THAT(msg, HasSubstr(path)) << k.name;
    for (const auto& e : k.expect) EXPECT_THAT(msg, HasSubstr(e)) << k.name;
  }
  // Nothing was built or charged, and the session still works.
  EXPECT_TRUE(c->Stores()->empty());
  EXPECT_EQ(c->Status()->used_bytes, 0u);
  const Checkpoint ck = MakeCheckpoint(dir + "/good.safetensors");
  EXPECT_TRUE(c->OpenStore({ck.path}, Nf4Spec()).ok());
}

// The header is checked as it is parsed, never built into a JSON document: a document costs
// many times the header's bytes (a 40 MB header of nested arrays took 1.5 GB), which any client
// could ask of the daemon with each store request. Headers of 32 MiB, one deeply nested and one
// wide where only skipped keys are, are refused or read without the daemon's peak memory growing
// much beyond the header itself; keys tsd does not know are skipped, as safetensors' readers do.
TEST(Stores, AHugeHeaderCostsTheDaemonLittleMoreThanItsBytes) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  auto c = Attached(*d, "job");
  const uint64_t before = d->PeakRssKib();
  ASSERT_GT(before, 0u);
  constexpr size_t kBytes = 32 << 20;
  const std::string head = R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16],"extra":)";
  const std::string deep =
      head + std::string(kBytes / 2, '[') + std::string(kBytes / 2, ']') + "}}";
  std::string wide = head + "[0";
  wide.reserve(kBytes + 64);
  while (wide.size() < kBytes) wide += ",0";
  wide += "]}}";
  const std::string deep_path = d->dir() + "/deep.safetensors";
  const std::string wide_path = d->dir() + "/wide.safetensors";
  WriteSafetensors(deep_path, {}, deep);
  std::ofstream(deep_path, std::ios::app) << std::string(16, 'x');
  WriteSafetensors(wide_path, {}, wide);
  std::ofstream(wide_path, std::ios::app) << std::string(16, 'x');
  auto refused = c->OpenStore({deep_path}, StoreSpec{});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("nested deeper than 16"));
  // The wide one is a valid checkpoint of one tensor: its unknown key's array is skipped.
  auto wide_store = c->OpenStore({wide_path}, StoreSpec{});
  ASSERT_TRUE(wide_store.ok()) << wide_store.status();
  // The header's bytes, read once and kept for the store's digest, plus slack; a JSON
  // document of either header would be hundreds of MiB.
  ExpectPeakRssGrowthBelow(*d, before, 3 * (kBytes >> 10) + (32 << 10), "32 MiB headers");
}

TEST(Stores, ACopyOfTheCheckpointElsewhereSharesTheStore) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  const Checkpoint ck = MakeCheckpoint(d->dir() + "/model.safetensors");
  const std::string copy = d->dir() + "/copy.safetensors";
  ASSERT_EQ(system(("cp " + ck.path + " " + copy).c_str()), 0);
  auto a = Attached(*d, "a"), b = Attached(*d, "b");
  auto va = a->OpenStore({ck.path}, Nf4Spec());
  auto vb = b->OpenStore({copy}, Nf4Spec());
  ASSERT_TRUE(va.ok() && vb.ok());
  EXPECT_EQ((*va)->id(), (*vb)->id());
  ASSERT_EQ(a->Stores()->size(), 1u);
  EXPECT_EQ((*a->Stores())[0].users, 2u);
  EXPECT_EQ(a->Status()->used_bytes, (*va)->size());
  // The copy's identity now names the store: a third job finds it without reading.
  auto c = Attached(*d, "c");
  auto vc = c->OpenStore({copy}, Nf4Spec());
  ASSERT_TRUE(vc.ok());
  EXPECT_FALSE((*vc)->built());
  EXPECT_EQ((*vc)->id(), (*va)->id());
}

}  // namespace
}  // namespace tsd::testing
