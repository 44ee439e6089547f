// Device copies of weight stores without a GPU (CI): the CUDA driver API is loaded at run time and
// a missing or unusable driver is a clear status, never a crash or a link error (the driver types
// tsd declares are checked against cuda.h in cuda_abi_test.cc); GPU UUIDs are parsed strictly;
// `gpu_stores` is off by default and, off or without a driver, a request for a device copy is
// refused saying why while the host store keeps working. The GPU half (two processes mapping one
// copy) is tests/python/test_gpu_stores.py.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint_file.h"
#include "daemon/cuda/device_allocation.h"
#include "daemon/cuda/device_mapping.h"
#include "daemon/cuda/driver_api.h"
#include "daemon/ops/config.h"
#include "daemon/stores/device_copies.h"
#include "daemon/stores/store_manager.h"

namespace tsd {
namespace {

using ::testing::HasSubstr;

TEST(CudaDriverApi, AMissingDriverIsAClearFailedPrecondition) {
  auto api = cuda::DriverApi::Load("libcuda-absent-for-tsd-test.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(api.status().message(), HasSubstr("cannot be loaded"));
  EXPECT_THAT(api.status().message(), HasSubstr("no NVIDIA driver"));
}

TEST(CudaDriverApi, ALibraryWithoutTheEntryPointsIsRefusedNamingTheFirstMissingOne) {
  auto api = cuda::DriverApi::Load("libm.so.6");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(api.status().message(), HasSubstr("no entry point cuInit"));
}

TEST(CudaDriverApi, TheSharedDriverIsLoadedOnceAndAgreesWithTheMachine) {
  auto a = cuda::DriverApi::Shared();
  auto b = cuda::DriverApi::Shared();
  ASSERT_EQ(a.ok(), b.ok());
  if (!a.ok()) {
    EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition) << a.status();
    GTEST_SKIP() << "no usable CUDA driver here: " << a.status().message();
  }
  EXPECT_EQ(a->get(), b->get());
  EXPECT_GT((*a)->driver_version, 11000);
  auto count = (*a)->DeviceCount();
  ASSERT_TRUE(count.ok()) << count.status();
  if (*count == 0) GTEST_SKIP() << "the driver sees no GPU";
  auto uuid = (*a)->UuidOf(0);
  ASSERT_TRUE(uuid.ok()) << uuid.status();
  auto ordinal = (*a)->FindDevice(*uuid);
  ASSERT_TRUE(ordinal.ok()) << ordinal.status();
  EXPECT_EQ(*ordinal, 0);
  auto none = (*a)->FindDevice("GPU-00000000-0000-0000-0000-000000000000");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr(*uuid));
}

TEST(GpuUuid, IsNormalisedToNvidiaSmisForm) {
  const std::string want = "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11";
  EXPECT_EQ(*cuda::NormalizeGpuUuid(want), want);
  EXPECT_EQ(*cuda::NormalizeGpuUuid("5C1B3B8E0B3A8F2E6C1D2A6E9C7F0D11"), want);
  EXPECT_EQ(*cuda::NormalizeGpuUuid("gpu-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11"), want);
  for (const char* bad :
       {"", "GPU-", "0", "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d1",
        "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d111", "GPU-zz1b3b8e0b3a8f2e6c1d2a6e9c7f0d11",
        "MIG-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11"}) {
    auto got = cuda::NormalizeGpuUuid(bad);
    ASSERT_FALSE(got.ok()) << bad;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(got.status().message(), HasSubstr("not a GPU UUID"));
  }
}

absl::StatusOr<LoadedConfig> Load(std::vector<std::string> args) {
  args.insert(args.begin(), "tsd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return LoadConfig(static_cast<int>(argv.size()), argv.data());
}

TEST(GpuStoresSetting, IsOffByDefaultAndTakesOnlyABool) {
  auto plain = Load({});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->config.gpu_stores);
  EXPECT_THAT(ConfigToToml(plain->config), HasSubstr("gpu_stores = false"));
  auto on = Load({"--gpu-stores"});
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->action, Action::kRun);
  EXPECT_TRUE(on->config.gpu_stores);
  EXPECT_THAT(ConfigToToml(on->config), HasSubstr("gpu_stores = true"));
  // From the file: a bool, nothing else.
  char tmpl[] = "/tmp/tsd-gpu-stores-config-XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  close(fd);
  std::ofstream(tmpl) << "gpu_stores = true\n";
  auto file = Load({"--config", tmpl});
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->config.gpu_stores);
  std::ofstream(tmpl) << "gpu_stores = \"yes\"\n";
  auto bad = Load({"--config", tmpl});
  unlink(tmpl);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("'gpu_stores' must be true or false"));
}

class GpuStoresTest : public ::testing::Test {
 protected:
  GpuStoresTest() : ledger_(64 << 20, 16 << 20) {
    char tmpl[] = "/tmp/tsd-gpu-store-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
    path_ = testing::WriteF32Checkpoint(dir_ + "/w.safetensors", 256, '\x02');
  }
  ~GpuStoresTest() override { std::filesystem::remove_all(dir_); }

  uint64_t OpenStore(stores::StoreManager& m, uint64_t session, const stores::StoreUser& user) {
    const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_TRUE(m.StageFile(session, user, fd).ok());
    auto opened = m.Open(session, user, stores::StoreSpec{}, getuid());
    EXPECT_TRUE(opened.ok()) << opened.status();
    if (!opened.ok()) return 0;
    close(opened->fd);
    return opened->status.id;
  }

  Ledger ledger_;
  std::string dir_, path_;
};

TEST_F(GpuStoresTest, OffByDefaultARequestIsRefusedNamingTheSettingAndTheHostStoreWorks) {
  std::atomic<int> loads{0};
  stores::StoreManager m(ledger_, {.gpu_driver = [&loads]() {
                           ++loads;
                           return cuda::DriverApi::Load("libcuda-absent.so.1");
                         }});
  const stores::StoreUser job{"a", 1};
  const uint64_t id = OpenStore(m, 1, job);
  auto copy = m.OpenDeviceCopy(job, id, "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11");
  ASSERT_FALSE(copy.ok());
  EXPECT_EQ(copy.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(copy.status().message(), HasSubstr("gpu_stores = false"));
  EXPECT_EQ(loads.load(), 0) << "with the setting off, the driver is never loaded";
  auto list = m.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].users, 1u);
  EXPECT_TRUE(list[0].device_copies.empty());
  EXPECT_EQ(m.Totals().device_bytes, 0u);
}

TEST_F(GpuStoresTest, OnWithoutADriverARequestIsRefusedSayingWhyAndTheDriverIsTriedOnce) {
  std::atomic<int> loads{0};
  stores::StoreManager m(ledger_, {.gpu_stores = true, .gpu_driver = [&loads]() {
                                     ++loads;
                                     return cuda::DriverApi::Load("libcuda-absent.so.1");
                                   }});
  EXPECT_EQ(loads.load(), 0) << "the driver is loaded when a job first asks, not at start";
  const stores::StoreUser job{"a", 1}, other{"b", 1};
  const uint64_t id = OpenStore(m, 1, job);
  for (int i = 0; i < 2; ++i) {
    auto copy = m.OpenDeviceCopy(job, id, "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11");
    ASSERT_FALSE(copy.ok());
    EXPECT_EQ(copy.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(copy.status().message(), HasSubstr("cannot use a GPU"));
    EXPECT_THAT(copy.status().message(), HasSubstr("libcuda-absent.so.1"));
    EXPECT_THAT(copy.status().message(), HasSubstr("the host store still works"));
  }
  EXPECT_EQ(loads.load(), 1);
  // A bad UUID and a job that does not use the store are refused before anything else.
  auto bad = m.OpenDeviceCopy(job, id, "cuda:0");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("not a GPU UUID"));
  auto stranger = m.OpenDeviceCopy(other, id, "GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11");
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(stranger.status().message(), HasSubstr("does not use store"));
  // The host store is untouched: a second job still maps it.
  EXPECT_EQ(OpenStore(m, 2, other), id);
  EXPECT_EQ(m.List()[0].users, 2u);
}

// The GPU half (skipped without one): what tsd exports, a process imports with the same bytes.
std::shared_ptr<const cuda::DriverApi> GpuOrSkip() {
  auto api = cuda::DriverApi::Shared();
  if (!api.ok()) return nullptr;
  auto count = (*api)->DeviceCount();
  return count.ok() && *count > 0 ? *api : nullptr;
}

TEST(DeviceMemory, AnExportedCopyImportsWithTheStoresBytesAndAZeroTail) {
  auto api = GpuOrSkip();
  if (api == nullptr) GTEST_SKIP() << "needs a CUDA GPU and driver";
  const uint64_t n = (3u << 20) + 5;
  std::string host(n, '\0');
  for (uint64_t i = 0; i < n; ++i) host[i] = static_cast<char>(i * 131 + 7);
  auto alloc = cuda::DeviceAllocation::Create(api, 0, n);
  ASSERT_TRUE(alloc.ok()) << alloc.status();
  ASSERT_GE((*alloc)->size(), n);
  ASSERT_TRUE((*alloc)->Fill(host.data(), n).ok());
  auto fd = (*alloc)->Export();
  ASSERT_TRUE(fd.ok()) << fd.status();
  auto mapped = cuda::DeviceMapping::Import(api, *fd, (*alloc)->size(), 0);
  close(*fd);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  std::cout << "device mapping read-only: " << (*mapped)->read_only() << " "
            << (*mapped)->access_note() << "\n";
  auto ctx = cuda::PrimaryContext::Retain(api, 0);
  ASSERT_TRUE(ctx.ok());
  auto scope = (*ctx)->Enter();
  ASSERT_TRUE(scope.ok());
  std::string back((*alloc)->size(), '\1');
  ASSERT_TRUE(
      api->Check(api->cuMemcpyDtoH(back.data(), (*mapped)->address(), back.size()), "cuMemcpyDtoH")
          .ok());
  EXPECT_EQ(back.substr(0, n), host);
  EXPECT_EQ(back.substr(n), std::string(back.size() - n, '\0'));
  // The daemon's allocation may go first: the importer's mapping keeps the memory.
  alloc->reset();
  std::string again(16, '\1');
  ASSERT_TRUE(api->Check(api->cuMemcpyDtoH(again.data(), (*mapped)->address(), 16), "DtoH").ok());
  EXPECT_EQ(again, host.substr(0, 16));
}

TEST_F(GpuStoresTest, OnAGpuJobsShareOneCopyThatFollowsTheStoresLifetime) {
  auto api = GpuOrSkip();
  if (api == nullptr) GTEST_SKIP() << "needs a CUDA GPU and driver";
  auto uuid = api->UuidOf(0);
  ASSERT_TRUE(uuid.ok());
  stores::StoreManager m(ledger_, {.keep = absl::Hours(1), .gpu_stores = true});
  const stores::StoreUser a{"a", 1}, b{"b", 1};
  const uint64_t id = OpenStore(m, 1, a);
  ASSERT_EQ(OpenStore(m, 2, b), id);
  auto ca = m.OpenDeviceCopy(a, id, *uuid);
  ASSERT_TRUE(ca.ok()) << ca.status();
  auto cb = m.OpenDeviceCopy(b, id, uuid->substr(4));  // without "GPU-": the same GPU
  ASSERT_TRUE(cb.ok()) << cb.status();
  EXPECT_EQ(ca->size, cb->size);
  EXPECT_EQ(ca->data_bytes, 4096u);
  EXPECT_EQ(cb->gpu_uuid, *uuid);
  close(ca->fd);
  close(cb->fd);
  auto copies = m.List()[0].device_copies;
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].users, 2u);
  EXPECT_EQ(copies[0].gpu_uuid, *uuid);
  EXPECT_EQ(m.Totals().device_bytes, copies[0].bytes);
  ASSERT_TRUE(m.Close(a, id).ok());
  EXPECT_EQ(m.List()[0].device_copies[0].users, 1u);
  m.UserReleased(b);  // b died
  copies = m.List()[0].device_copies;
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].users, 0u) << "kept warm like its store";
  m.Sweep(absl::Now() + absl::Hours(2));
  EXPECT_TRUE(m.List().empty());
  EXPECT_EQ(m.Totals().device_bytes, 0u);
}

}  // namespace
}  // namespace tsd
