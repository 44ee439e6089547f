#include "daemon/stores/device_copies.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd::stores {

DeviceCopies::DeviceCopies(bool enabled, DriverLoader loader)
    : enabled_(enabled),
      loader_(std::move(loader)),
      driver_(absl::FailedPreconditionError("the CUDA driver is not loaded yet")) {}

DeviceCopies::~DeviceCopies() {
  std::vector<CopyPtr> dead;
  MutexLock lock(mu_);
  while (!copies_.empty()) DropLocked(copies_.begin()->first, "shutdown", dead);
}

absl::StatusOr<std::shared_ptr<const cuda::DriverApi>> DeviceCopies::Driver() {
  {
    MutexLock lock(mu_);
    if (driver_tried_) return driver_;
  }
  auto loaded = loader_();
  MutexLock lock(mu_);
  if (!driver_tried_) {
    driver_tried_ = true;
    driver_ = loaded;
    if (loaded.ok()) {
      spdlog::info("event=gpu_stores_driver library={} driver_version={}", (*loaded)->library,
                   (*loaded)->driver_version);
    } else {
      spdlog::warn("event=gpu_stores_unavailable error=\"{}\"",
                   std::string(loaded.status().message()));
    }
  }
  return driver_;
}

absl::StatusOr<OpenedDeviceCopy> DeviceCopies::Open(uint64_t store, const std::string& user,
                                                    const void* data, uint64_t bytes,
                                                    const std::string& gpu_uuid) {
  if (!enabled_) {
    return absl::FailedPreconditionError(
        "this tsd keeps no device copies of stores (gpu_stores = false): set gpu_stores = true "
        "in tsd.toml (or run tsd --gpu-stores true) on a machine with the NVIDIA driver, or "
        "use the host store");
  }
  TSD_ASSIGN_OR_RETURN(const std::string uuid, cuda::NormalizeGpuUuid(gpu_uuid));
  auto driver = Driver();
  if (!driver.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("gpu_stores is on, but this tsd cannot use a GPU: ", driver.status().message(),
                     "; the host store still works"));
  }
  std::shared_ptr<const cuda::DriverApi> api = *driver;
  TSD_ASSIGN_OR_RETURN(const int ordinal, api->FindDevice(uuid));
  const Key key{store, uuid};
  CopyPtr copy;
  bool maker = false;
  {
    MutexLock lock(mu_);
    auto it = copies_.find(key);
    if (it != copies_.end()) {
      copy = it->second;
    } else {
      copy = std::make_shared<Copy>();
      copy->store = store;
      copy->gpu_uuid = uuid;
      copy->ordinal = ordinal;
      copy->data_bytes = bytes;
      copies_[key] = copy;
      maker = true;
    }
    copy->users.insert(user);
  }
  if (maker) {
    absl::Status made = Make(copy, api, data);
    MutexLock lock(mu_);
    if (made.ok()) {
      copy->ready = true;
    } else {
      copy->failure = made;
      auto it = copies_.find(key);
      if (it != copies_.end() && it->second == copy) copies_.erase(it);
    }
    made_.NotifyAll();
  }
  MutexLock lock(mu_);
  while (!copy->ready && copy->failure.ok()) made_.Wait(mu_);
  if (!copy->failure.ok()) {
    copy->users.erase(user);
    return absl::Status(copy->failure.code(),
                        absl::StrCat("the device copy of store ", store, " on ", uuid,
                                     " could not be made: ", copy->failure.message()));
  }
  auto it = copies_.find(key);
  if (it == copies_.end() || it->second != copy || copy->users.count(user) == 0) {
    return absl::AbortedError(absl::StrCat("the device copy of store ", store, " on ", uuid,
                                           " was dropped (its store or job went) meanwhile"));
  }
  copy->last_used = absl::Now();
  OpenedDeviceCopy out;
  TSD_ASSIGN_OR_RETURN(out.fd, copy->memory->Export());
  out.gpu_uuid = uuid;
  out.size = copy->memory->size();
  out.data_bytes = copy->data_bytes;
  return out;
}

absl::Status DeviceCopies::Make(const CopyPtr& copy, std::shared_ptr<const cuda::DriverApi> api,
                                const void* data) {
  const absl::Time start = absl::Now();
  for (;;) {
    auto memory = cuda::DeviceAllocation::Create(api, copy->ordinal, copy->data_bytes);
    if (memory.ok()) {
      TSD_RETURN_IF_ERROR((*memory)->Fill(data, copy->data_bytes));
      copy->memory = std::move(*memory);
      break;
    }
    if (memory.status().code() != absl::StatusCode::kResourceExhausted) return memory.status();
    std::vector<CopyPtr> dead;
    MutexLock lock(mu_);
    if (!EvictOneOnGpuLocked(copy->ordinal, dead)) {
      return absl::ResourceExhaustedError(
          absl::StrCat(memory.status().message(), ": GPU ", copy->gpu_uuid, " has no room for ",
                       copy->data_bytes, " bytes and every device copy on it is in use"));
    }
  }
  spdlog::info("event=device_copy_made store={} gpu={} bytes={} seconds={:.3f}", copy->store,
               copy->gpu_uuid, copy->memory->size(), absl::ToDoubleSeconds(absl::Now() - start));
  return absl::OkStatus();
}

bool DeviceCopies::EvictOneOnGpuLocked(int ordinal, std::vector<CopyPtr>& dead) {
  const Key* oldest = nullptr;
  absl::Time when = absl::InfiniteFuture();
  for (const auto& [key, c] : copies_) {
    if (!c->ready || !c->users.empty() || c->ordinal != ordinal) continue;
    if (c->last_used < when) {
      when = c->last_used;
      oldest = &key;
    }
  }
  if (oldest == nullptr) return false;
  DropLocked(*oldest, "evicted", dead);
  return true;
}

void DeviceCopies::DropLocked(const Key& key, const char* reason, std::vector<CopyPtr>& dead) {
  auto it = copies_.find(key);
  if (it == copies_.end()) return;
  CopyPtr c = it->second;
  copies_.erase(it);
  if (c->ready) {
    spdlog::info("event=device_copy_dropped store={} gpu={} bytes={} reason={}", c->store,
                 c->gpu_uuid, c->memory->size(), reason);
  }
  dead.push_back(std::move(c));
}

void DeviceCopies::Leave(uint64_t store, const std::string& user) {
  MutexLock lock(mu_);
  for (auto& [key, c] : copies_) {
    if (key.first == store && c->users.erase(user) != 0 && c->users.empty()) {
      c->last_used = absl::Now();
    }
  }
}

void DeviceCopies::UserReleased(const std::string& user) {
  MutexLock lock(mu_);
  for (auto& [key, c] : copies_) {
    if (c->users.erase(user) != 0 && c->users.empty()) c->last_used = absl::Now();
  }
}

void DeviceCopies::DropStore(uint64_t store, const char* reason) {
  std::vector<CopyPtr> dead;
  MutexLock lock(mu_);
  std::vector<Key> keys;
  for (const auto& [key, c] : copies_) {
    if (key.first == store) keys.push_back(key);
  }
  for (const Key& k : keys) DropLocked(k, reason, dead);
}

void DeviceCopies::Sweep(absl::Time now, absl::Duration keep) {
  std::vector<CopyPtr> dead;
  MutexLock lock(mu_);
  std::vector<Key> keys;
  for (const auto& [key, c] : copies_) {
    if (c->ready && c->users.empty() && now - c->last_used >= keep) keys.push_back(key);
  }
  for (const Key& k : keys) DropLocked(k, "keep_expired", dead);
}

std::vector<DeviceCopyStatus> DeviceCopies::Of(uint64_t store) const {
  std::vector<DeviceCopyStatus> out;
  MutexLock lock(mu_);
  const absl::Time now = absl::Now();
  for (const auto& [key, c] : copies_) {
    if (key.first != store || !c->ready) continue;
    out.push_back({c->gpu_uuid, c->memory->size(), static_cast<uint32_t>(c->users.size()),
                   c->users.empty() ? absl::ToDoubleSeconds(now - c->last_used) : 0.0});
  }
  return out;
}

uint64_t DeviceCopies::TotalBytes() const {
  uint64_t total = 0;
  MutexLock lock(mu_);
  for (const auto& [key, c] : copies_) {
    if (c->ready) total += c->memory->size();
  }
  return total;
}

}  // namespace tsd::stores
