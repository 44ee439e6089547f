#include "daemon/stores/store_manager.h"

// xxHash compiled in (header only), so the daemon needs no libxxhash at run time.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/status_macros.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace tsd::stores {
namespace {

constexpr const char* kLabel = "data";  // the one charge of a store in the ledger

// A user's name among a device copy's users.
std::string UserKey(const StoreUser& user) { return absl::StrCat(user.job, "#", user.instance); }

void CloseAll(std::vector<SourceFile>& files) {
  for (SourceFile& f : files) {
    if (f.fd >= 0) close(f.fd);
    f.fd = -1;
  }
}

// Closes the descriptors of `files` when it goes out of scope.
struct FilesCloser {
  std::vector<SourceFile>& files;
  ~FilesCloser() { CloseAll(files); }
};

// The identity of what `spec` asks for, apart from the files.
std::string SpecKey(const StoreSpec& spec) {
  std::string list = "all";
  if (!spec.tensors.empty()) {
    std::vector<std::string> names;
    for (const auto& t : spec.tensors)
      names.push_back(absl::StrCat(t.name, t.quantize ? "+q" : ""));
    std::sort(names.begin(), names.end());
    const std::string joined = absl::StrJoin(names, std::string(1, '\0'));
    list = absl::StrCat(names.size(), ":", XXH3_64bits(joined.data(), joined.size()));
  }
  const uint32_t block = spec.format == StoreFormat::kNone ? 0 : spec.block_size;
  return absl::StrCat(StoreFormatName(spec.format), "/", block, "/", list);
}

std::string FileKey(const std::vector<SourceFile>& files) {
  std::string key;
  for (const SourceFile& f : files) {
    absl::StrAppend(&key, f.st.st_dev, ":", f.st.st_ino, ":", f.st.st_size, ":",
                    f.st.st_mtim.tv_sec, ".", f.st.st_mtim.tv_nsec, ";");
  }
  return key;
}

absl::Status CheckSpec(const StoreSpec& spec) {
  if (spec.format != StoreFormat::kNone && (spec.block_size < 1 || spec.block_size > (1u << 20))) {
    return absl::InvalidArgumentError(absl::StrCat("store block size ", spec.block_size,
                                                   " is outside 1..1048576; 64 is the usual one"));
  }
  if (spec.tensors.size() > (1u << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a store request names ", spec.tensors.size(), " tensors; at most 1048576"));
  }
  for (const auto& t : spec.tensors) {
    if (t.name.empty() || t.name.size() > 1024) {
      return absl::InvalidArgumentError(
          "a store request names a tensor with an empty or over-long (> 1024 bytes) name");
    }
    if (t.quantize && spec.format == StoreFormat::kNone) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name,
                       "' is marked to quantize, but the store's format is 'none'; ask "
                       "for nf4 or int8, or do not mark it"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

StoreManager::StoreManager(Ledger& ledger, StoreManagerOptions options)
    : ledger_(ledger),
      options_(options),
      keep_(options.keep),
      device_copies_(options.gpu_stores,
                     options.gpu_driver ? options.gpu_driver
                                        : DeviceCopies::DriverLoader(&cuda::DriverApi::Shared)) {
  sweeper_ = std::thread([this] { SweeperLoop(); });
}

StoreManager::~StoreManager() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
    wake_.NotifyAll();
  }
  sweeper_.join();
  std::vector<StorePtr> dead;
  MutexLock lock(mu_);
  for (auto& [session, staged] : staged_) CloseAll(staged.files);
  staged_.clear();
  while (!stores_.empty()) {
    StorePtr s = stores_.begin()->second;
    if (s->state == State::kReady) {
      DropLocked(s, "shutdown", dead);
    } else {
      stores_.erase(stores_.begin());
    }
  }
}

absl::Status StoreManager::StageFile(uint64_t session, const StoreUser& user, int fd) {
  std::vector<SourceFile> one(1);
  one[0].fd = fd;
  FilesCloser closer{one};
  if (fd < 0) {
    return absl::InvalidArgumentError(
        "a store_file request must carry a checkpoint file's descriptor (SCM_RIGHTS); none came "
        "with it");
  }
  SourceFile& f = one[0];
  if (fstat(fd, &f.st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the checkpoint descriptor cannot be examined: ", std::strerror(errno)));
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags >= 0 && (flags & O_PATH) != 0) {
    return absl::PermissionDeniedError(
        "the checkpoint descriptor was opened with O_PATH, which proves no right to read the "
        "file; open it for reading and send that descriptor");
  }
  if (!S_ISREG(f.st.st_mode)) {
    return absl::InvalidArgumentError(
        "the checkpoint descriptor is not a regular file; open the .safetensors file itself");
  }
  if (flags < 0 || (flags & O_ACCMODE) == O_WRONLY) {
    return absl::PermissionDeniedError(
        "the checkpoint descriptor is open write-only; open the file for reading");
  }
  char byte = 0;
  if (f.st.st_size > 0 && pread(fd, &byte, 1, 0) != 1) {
    return absl::PermissionDeniedError(
        absl::StrCat("the checkpoint descriptor cannot be read (", std::strerror(errno), ")"));
  }
  std::error_code ec;
  const auto path = std::filesystem::read_symlink(absl::StrCat("/proc/self/fd/", fd), ec);
  MutexLock lock(mu_);
  Staged& staged = staged_[session];
  if (staged.files.empty()) staged.user = user;
  if (staged.files.size() >= options_.max_staged_files) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "session ", session, " has staged ", staged.files.size(),
        " checkpoint files, the limit; open the store (open_store) before sending more"));
  }
  f.label = ec ? absl::StrCat("checkpoint file ", staged.files.size() + 1) : path.string();
  // The name is the client's choice: no control characters into logs and replies.
  for (char& ch : f.label) {
    if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f || ch == '"') ch = '?';
  }
  staged.files.push_back(f);
  one[0].fd = -1;  // kept
  return absl::OkStatus();
}

absl::StatusOr<OpenedStore> StoreManager::Open(uint64_t session, const StoreUser& user,
                                               const StoreSpec& spec, uid_t uid) {
  std::vector<SourceFile> files;
  {
    MutexLock lock(mu_);
    auto it = staged_.find(session);
    if (it != staged_.end()) {
      files = std::move(it->second.files);
      staged_.erase(it);
    }
  }
  FilesCloser closer{files};
  TSD_RETURN_IF_ERROR(CheckSpec(spec));
  if (files.empty()) {
    return absl::PermissionDeniedError(
        "a store is opened only with the descriptors of its checkpoint files, which prove the "
        "caller may read them; none were sent (send each file with a store_file request first)");
  }
  const std::string key = FileKey(files) + "|" + SpecKey(spec);
  StorePtr store;
  bool builder = false;
  {
    MutexLock lock(mu_);
    auto it = by_key_.find(key);
    if (it != by_key_.end()) {
      store = it->second;
    } else {
      store = std::make_shared<Store>();
      store->id = next_id_++;
      store->keys.push_back(key);
      store->spec = spec;
      std::vector<std::string> paths;
      for (const SourceFile& f : files) paths.push_back(f.label);
      store->source = absl::StrJoin(paths, ",");
      store->holder =
          absl::StrCat(store->id, ":", std::filesystem::path(files[0].label).filename().string());
      stores_[store->id] = store;
      by_key_[key] = store;
      builder = true;
    }
    // Counted at once, so a job released while it waits is no longer counted when it ends.
    store->users.insert(user);
  }
  if (builder) {
    absl::Status built = Build(store, files);
    if (!built.ok()) return built;
  }
  MutexLock lock(mu_);
  const absl::Time deadline = absl::Now() + options_.build_wait;
  while (store->state == State::kBuilding) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      store->users.erase(user);
      return absl::DeadlineExceededError(absl::StrCat(
          "store ", store->id, " (", store->source,
          ") is still being built by another job's "
          "request after ",
          absl::FormatDuration(options_.build_wait),
          "; try again later (a large checkpoint takes a while to read and quantize)"));
    }
    built_.WaitFor(mu_, absl::ToChronoMilliseconds(left) + std::chrono::milliseconds(1));
  }
  if (store->state == State::kFailed) {
    return absl::Status(store->failure.code(),
                        absl::StrCat("building store ", store->id, " (for another request of ",
                                     "the same checkpoint) failed: ", store->failure.message()));
  }
  while (store->moved_to) store = store->moved_to;  // a copy of a store built before
  if (store->users.count(user) == 0) {
    return absl::AbortedError(absl::StrCat("job '", user.job, "' was released while store ",
                                           store->id, " was being built"));
  }
  ProvedLocked(*store, uid);
  store->last_used = absl::Now();
  return Describe(*store, builder);
}

void StoreManager::ProvedLocked(Store& store, uid_t uid) {
  auto it = std::find(store.provers.begin(), store.provers.end(), uid);
  if (it != store.provers.end()) store.provers.erase(it);
  store.provers.push_back(uid);
  const size_t bound = std::max<size_t>(options_.max_provers, 1);
  if (store.provers.size() > bound) {
    spdlog::debug("event=store_prover_forgotten store={} uid={} bound={}", store.id,
                  store.provers.front(), bound);
    store.provers.erase(store.provers.begin());
  }
}

absl::Status StoreManager::Build(const StorePtr& store, const std::vector<SourceFile>& files) {
  const absl::Time start = absl::Now();
  Reservation reserved;
  std::unique_ptr<SealedMemory> memory;
  std::string digest;
  StorePlan plan;
  absl::Status status = [&]() -> absl::Status {
    TSD_ASSIGN_OR_RETURN(plan, PlanStore(files, store->spec));
    // The charge, evicting unused stores while the pool or the budget is short.
    for (;;) {
      auto got = ledger_.Reserve(Holder::Store(store->holder), kLabel, plan.bytes);
      if (got.ok()) {
        reserved = std::move(*got);
        break;
      }
      if (got.status().code() != absl::StatusCode::kResourceExhausted) return got.status();
      std::vector<StorePtr> dead;
      MutexLock lock(mu_);
      if (!EvictOneLocked(dead)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            got.status().message(), "; every store is in use, so none could be evicted"));
      }
    }
    TSD_ASSIGN_OR_RETURN(memory, SealedMemory::Create(plan.bytes, "tsd:store"));
    TSD_ASSIGN_OR_RETURN(digest, FillStore(plan, files, memory->data(), options_.isa));
    return memory->Seal(options_.lock_memory);
  }();
  std::vector<StorePtr> dead;
  MutexLock lock(mu_);
  if (status.ok()) {
    const std::string digest_key = absl::StrCat(digest, "|", SpecKey(store->spec));
    auto copy = by_digest_.find(digest_key);
    if (copy != by_digest_.end() && copy->second->state == State::kReady) {
      // The same checkpoint, found elsewhere on disk: share the store built before.
      StorePtr other = copy->second;
      ForgetLocked(store);
      for (const std::string& k : store->keys) {
        other->keys.push_back(k);
        by_key_[k] = other;
      }
      other->users.insert(store->users.begin(), store->users.end());
      other->last_used = absl::Now();
      store->moved_to = other;
      store->state = State::kReady;
      built_.NotifyAll();
      spdlog::info("event=store_copy_found store={} source=\"{}\" digest={} same_as={}", store->id,
                   store->source, digest, other->id);
      return absl::OkStatus();  // `reserved` returns its bytes; `memory` is dropped
    }
    status = ledger_.Commit(reserved);
    if (status.ok()) {
      store->memory = std::move(memory);
      store->tensors = std::move(plan.tensors);
      store->digest = digest;
      store->digest_key = digest_key;
      store->bytes = plan.bytes;
      store->last_used = absl::Now();
      store->state = State::kReady;
      by_digest_[digest_key] = store;
      built_.NotifyAll();
      spdlog::info(
          "event=store_built store={} source=\"{}\" format={} block_size={} tensors={} bytes={} "
          "digest={} seconds={:.3f} locked={}",
          store->id, store->source, StoreFormatName(store->spec.format), store->spec.block_size,
          store->tensors.size(), store->bytes, digest, absl::ToDoubleSeconds(absl::Now() - start),
          store->memory->locked());
      if (store->users.empty()) LeftLocked(store, dead);  // its job was released meanwhile
      return absl::OkStatus();
    }
  }
  ForgetLocked(store);
  store->state = State::kFailed;
  store->failure = status;
  built_.NotifyAll();
  spdlog::warn("event=store_build_failed store={} source=\"{}\" error=\"{}\"", store->id,
               store->source, std::string(status.message()));
  return status;
}

StoreStatus StoreManager::StatusOf(const Store& store, absl::Time now) const {
  StoreStatus s;
  s.id = store.id;
  s.source = store.source;
  s.format = StoreFormatName(store.spec.format);
  s.block_size = store.spec.format == StoreFormat::kNone ? 0 : store.spec.block_size;
  s.bytes = store.bytes;
  s.users = static_cast<uint32_t>(store.users.size());
  s.idle_s = store.users.empty() ? absl::ToDoubleSeconds(now - store.last_used) : 0;
  s.digest = store.digest;
  s.tensors = static_cast<uint32_t>(store.tensors.size());
  s.locked = store.memory != nullptr && store.memory->locked();
  s.device_copies = device_copies_.Of(store.id);
  return s;
}

absl::StatusOr<OpenedStore> StoreManager::Describe(const Store& store, bool built) const {
  OpenedStore out;
  TSD_ASSIGN_OR_RETURN(out.fd, store.memory->OpenReadOnly());
  out.status = StatusOf(store, absl::Now());
  out.tensors = store.tensors;
  out.built = built;
  return out;
}

void StoreManager::ForgetLocked(const StorePtr& store) {
  for (const std::string& k : store->keys) {
    auto it = by_key_.find(k);
    if (it != by_key_.end() && it->second == store) by_key_.erase(it);
  }
  stores_.erase(store->id);
}

void StoreManager::DropLocked(const StorePtr& store, const char* reason,
                              std::vector<StorePtr>& dead) {
  ForgetLocked(store);
  auto d = by_digest_.find(store->digest_key);
  if (d != by_digest_.end() && d->second == store) by_digest_.erase(d);
  if (absl::Status s = ledger_.Uncharge(Holder::Store(store->holder), kLabel, store->bytes);
      !s.ok()) {
    spdlog::error("event=ledger_mismatch store={} error=\"{}\"", store->id,
                  std::string(s.message()));
  }
  device_copies_.DropStore(store->id, reason);
  spdlog::info("event=store_dropped store={} source=\"{}\" bytes={} reason={}", store->id,
               store->source, store->bytes, reason);
  dead.push_back(store);
}

bool StoreManager::EvictOneLocked(std::vector<StorePtr>& dead) {
  StorePtr oldest;
  for (const auto& [id, s] : stores_) {
    if (s->state != State::kReady || !s->users.empty()) continue;
    if (oldest == nullptr || s->last_used < oldest->last_used) oldest = s;
  }
  if (oldest == nullptr) return false;
  ++evictions_;
  DropLocked(oldest, "evicted", dead);
  return true;
}

void StoreManager::LeftLocked(const StorePtr& store, std::vector<StorePtr>& dead) {
  store->last_used = absl::Now();
  if (store->users.empty() && store->state == State::kReady && keep_ <= absl::ZeroDuration()) {
    DropLocked(store, "unused", dead);
  }
}

absl::Status StoreManager::Close(const StoreUser& user, uint64_t id) {
  std::vector<StorePtr> dead;
  MutexLock lock(mu_);
  auto it = stores_.find(id);
  if (it == stores_.end() || it->second->state != State::kReady ||
      it->second->users.erase(user) == 0) {
    return absl::NotFoundError(
        absl::StrCat("job '", user.job, "' does not use store ", id, "; see tsctl stores"));
  }
  StorePtr store = it->second;
  device_copies_.Leave(id, UserKey(user));
  if (store->users.empty()) LeftLocked(store, dead);
  return absl::OkStatus();
}

absl::StatusOr<OpenedDeviceCopy> StoreManager::OpenDeviceCopy(const StoreUser& user, uint64_t id,
                                                              const std::string& gpu_uuid) {
  StorePtr store;
  {
    MutexLock lock(mu_);
    auto it = stores_.find(id);
    if (it == stores_.end() || it->second->state != State::kReady ||
        it->second->users.count(user) == 0) {
      return absl::NotFoundError(
          absl::StrCat("job '", user.job, "' does not use store ", id,
                       "; open the store (open_store) before asking for its device copy"));
    }
    store = it->second;  // keeps its host memory while the copy is made
  }
  // The store is sealed: its bytes are read through a read-only mapping made for this call.
  TSD_ASSIGN_OR_RETURN(auto view, store->memory->MapReadOnly());
  return device_copies_.Open(id, UserKey(user), view->data(), store->bytes, gpu_uuid);
}

void StoreManager::UserReleased(const StoreUser& user) {
  std::vector<StorePtr> dead;
  device_copies_.UserReleased(UserKey(user));
  MutexLock lock(mu_);
  for (auto it = staged_.begin(); it != staged_.end();) {
    if (it->second.user == user) {
      CloseAll(it->second.files);
      it = staged_.erase(it);
    } else {
      ++it;
    }
  }
  std::vector<StorePtr> left;
  for (const auto& [id, s] : stores_) {
    if (s->users.erase(user) != 0 && s->users.empty()) left.push_back(s);
  }
  for (const StorePtr& s : left) {
    if (s->state == State::kReady) LeftLocked(s, dead);
  }
}

uint64_t StoreManager::MakeRoom(uint64_t bytes) {
  std::vector<StorePtr> dead;
  MutexLock lock(mu_);
  uint64_t released = 0;
  while (ledger_.View().free_bytes() < bytes) {
    const size_t before = dead.size();
    if (!EvictOneLocked(dead)) break;
    released += dead[before]->bytes;
  }
  return released;
}

void StoreManager::Sweep(absl::Time now) {
  std::vector<StorePtr> dead;
  MutexLock lock(mu_);
  std::vector<StorePtr> expired;
  for (const auto& [id, s] : stores_) {
    if (s->state == State::kReady && s->users.empty() && now - s->last_used >= keep_) {
      expired.push_back(s);
    }
  }
  for (const StorePtr& s : expired) DropLocked(s, "keep_expired", dead);
  device_copies_.Sweep(now, keep_);
}

void StoreManager::SetKeep(absl::Duration keep) {
  MutexLock lock(mu_);
  keep_ = keep;
  wake_.NotifyAll();
}

void StoreManager::SweeperLoop() {
  for (;;) {
    {
      MutexLock lock(mu_);
      if (stopping_) return;
      // Often enough that a store is dropped within a tenth of `keep` (or 1 s) of expiring.
      const absl::Duration tick = std::clamp(keep_ / 10, absl::Milliseconds(10), absl::Seconds(1));
      wake_.WaitFor(mu_, absl::ToChronoMilliseconds(tick));
      if (stopping_) return;
    }
    Sweep(absl::Now());
  }
}

std::vector<StoreStatus> StoreManager::List() const {
  MutexLock lock(mu_);
  const absl::Time now = absl::Now();
  std::vector<StoreStatus> out;
  for (const auto& [id, s] : stores_) {
    if (s->state == State::kReady) out.push_back(StatusOf(*s, now));
  }
  return out;
}

StoreListing StoreManager::ListFor(std::optional<uid_t> uid) const {
  StoreListing out;
  {
    MutexLock lock(mu_);
    const absl::Time now = absl::Now();
    for (const auto& [id, s] : stores_) {
      if (s->state != State::kReady) continue;
      ++out.node_stores;
      out.node_bytes += s->bytes;
      if (!uid || std::find(s->provers.begin(), s->provers.end(), *uid) != s->provers.end()) {
        out.stores.push_back(StatusOf(*s, now));
      }
    }
  }
  out.budget_bytes = ledger_.View().store_budget_bytes;
  return out;
}

StoreTotals StoreManager::Totals() const {
  StoreTotals t;
  {
    MutexLock lock(mu_);
    for (const auto& [id, s] : stores_) {
      if (s->state != State::kReady) continue;
      ++t.stores;
      t.bytes += s->bytes;
      t.users += s->users.size();
    }
    t.evictions = evictions_;
  }
  t.device_bytes = device_copies_.TotalBytes();
  t.budget_bytes = ledger_.View().store_budget_bytes;
  return t;
}

}  // namespace tsd::stores
