// The StoreManager holds the node's weight stores: read-only sets of tensors (a base model's
// frozen weights in one format) that tsd builds itself from checkpoint files a job handed over as
// descriptors, seals, and lends to every job that asks for the same thing, so a node keeps one
// copy of a base however many jobs fine-tune it.
//
// Identity. A store is found by the identity of its source files (device, inode, size and
// modification time of each, in order) plus its format, block size and which tensors it holds
// and quantizes: a second job finds it without reading any tensor data. While building, tsd
// hashes the whole checkpoint (xxh3-64); a build from a copy of the same checkpoint elsewhere on
// disk ends up sharing the first store (its identity becomes another name of that store).
//
// Isolation. The only way to a store is to present descriptors of its source files, open for
// reading (which proves read access); a store's memory is handed out as a read-only descriptor of
// a sealed memfd (daemon/stores/sealed_memory.h): no client can write or resize it. Listing
// follows the same rule: a store remembers the uids that proved read access to it (the uid of
// each job whose staged descriptors built or found it) and `ListFor` shows a uid only those
// stores. A store keeps at most `max_provers` uids (clients are untrusted: the books stay
// bounded); a new one beyond that replaces the uid whose proof is oldest, which can still open
// the store by presenting its files again (and then sees it listed again).
//
// Lifetime. A store becomes visible only once complete; a build that fails for any reason leaves
// nothing, and requests for a store being built wait for that one build (up to `build_wait`,
// then DEADLINE_EXCEEDED saying so). Stores are reference-counted by the jobs using them; one
// nobody uses is kept for `keep` (so a restarted job attaches at once), then dropped, and unused
// stores are evicted, least recently used first, when the pool or the store budget needs room.
// Stores are charged to the Ledger's store budget and the pool (daemon/memory/ledger.h), never to
// a job's quota. They live in memory only and do not survive a daemon restart.
//
// Thread safety: every method may be called from any thread. One mutex guards the books; reading
// and quantizing files happens outside it. Lock order: callers' locks (the Registry's), then this
// one, then the Ledger's.
#pragma once

#include <sys/types.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/memory/ledger.h"
#include "daemon/stores/device_copies.h"
#include "daemon/stores/sealed_memory.h"
#include "daemon/stores/store_builder.h"
#include "kernels/cpu/adamw.h"
#include "proto/mutex.h"

namespace tsd::stores {

struct StoreManagerOptions {
  absl::Duration keep = absl::Minutes(10);          // how long an unused store is kept
  absl::Duration build_wait = absl::Minutes(10);    // how long a request waits for another's build
  bool lock_memory = false;                         // mlock() stores in the daemon
  kernels::Isa isa = kernels::Isa::kScalar;         // of the quantize kernels
  size_t max_staged_files = 1024;                   // per session
  size_t max_provers = 32;                          // uids a store remembers for listing (>= 1)
  bool gpu_stores = false;                          // device copies (the `gpu_stores` setting)
  DeviceCopies::DriverLoader gpu_driver = nullptr;  // loads the CUDA driver; null: libcuda.so.1
};

// A job using stores: its name and instance (a job re-created under the same name is another).
struct StoreUser {
  std::string job;
  uint64_t instance = 0;
  auto operator<=>(const StoreUser&) const = default;
};

// What `tsctl stores` shows of a store.
struct StoreStatus {
  uint64_t id = 0;
  std::string source;  // the source files' paths, as tsd saw them when it built the store
  std::string format;
  uint32_t block_size = 0;
  uint64_t bytes = 0;
  uint32_t users = 0;
  double idle_s = 0;  // since the last user left; 0 while in use
  std::string digest;
  uint32_t tensors = 0;
  bool locked = false;
  std::vector<DeviceCopyStatus> device_copies;  // with gpu_stores: its copies in VRAM
};

// A store as a job gets it: a read-only descriptor (owned by the caller) and the tensor table.
struct OpenedStore {
  int fd = -1;
  StoreStatus status;
  std::vector<StoredTensor> tensors;
  bool built = false;  // this request built it (else it existed, or another request built it)
};

// What `ListFor` shows: the stores a uid may see, and the node's totals at the same moment.
struct StoreListing {
  std::vector<StoreStatus> stores;  // by id
  uint64_t node_stores = 0;         // every complete store, seen or not
  uint64_t node_bytes = 0;          // their bytes
  uint64_t budget_bytes = 0;        // the node's store budget (store_budget)
};

// The aggregate figures of /metrics.
struct StoreTotals {
  uint64_t stores = 0;
  uint64_t bytes = 0;
  uint64_t users = 0;
  uint64_t budget_bytes = 0;
  uint64_t evictions = 0;     // since the daemon started
  uint64_t device_bytes = 0;  // device memory of the stores' copies on GPUs
};

class StoreManager final {
 public:
  StoreManager(Ledger& ledger, StoreManagerOptions options);
  ~StoreManager();  // stops the keep-warm sweeper and drops every store
  StoreManager(const StoreManager&) = delete;
  StoreManager& operator=(const StoreManager&) = delete;

  // Takes `fd`, a checkpoint file `user`'s session `session` opened, for its next Open. Refused
  // (and closed) unless it is a regular file open for reading.
  absl::Status StageFile(uint64_t session, const StoreUser& user, int fd) ABSL_LOCKS_EXCLUDED(mu_);
  // Finds or builds the store of the files `session` staged (in the order staged; they are
  // consumed either way) and `spec`, and counts `user` among its users. On success `uid` (the
  // session's, as the kernel reported it) has proved read access to the store's files: the store
  // is listed to it from now on (ListFor).
  absl::StatusOr<OpenedStore> Open(uint64_t session, const StoreUser& user, const StoreSpec& spec,
                                   uid_t uid) ABSL_LOCKS_EXCLUDED(mu_);
  // `user` stops using store `id` (NOT_FOUND when it does not use it).
  absl::Status Close(const StoreUser& user, uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // The copy of store `id`, which `user` uses, on GPU `gpu_uuid` (daemon/stores/device_copies.h),
  // made now if there is none. FAILED_PRECONDITION when gpu_stores is off or no GPU is usable.
  absl::StatusOr<OpenedDeviceCopy> OpenDeviceCopy(const StoreUser& user, uint64_t id,
                                                  const std::string& gpu_uuid)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `user` was released: it uses no store from now on, and its staged files are closed.
  void UserReleased(const StoreUser& user) ABSL_LOCKS_EXCLUDED(mu_);
  // Evicts unused stores, least recently used first, until `bytes` fit in the pool or none is
  // left to evict. Returns the bytes released.
  uint64_t MakeRoom(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops unused stores idle for `keep` or longer (the sweeper calls it; tests may too).
  void Sweep(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);
  void SetKeep(absl::Duration keep) ABSL_LOCKS_EXCLUDED(mu_);

  // Complete stores, by id: every one (tsd's own view; tests).
  std::vector<StoreStatus> List() const ABSL_LOCKS_EXCLUDED(mu_);
  // The complete stores `uid` proved read access to (every one when `uid` is nullopt: tsd's own
  // uid), with the node's count and bytes taken under the same lock, and the store budget.
  StoreListing ListFor(std::optional<uid_t> uid) const ABSL_LOCKS_EXCLUDED(mu_);
  StoreTotals Totals() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class State { kBuilding, kReady, kFailed };
  struct Store {
    uint64_t id = 0;
    std::string holder;  // its name in the ledger
    State state = State::kBuilding;
    absl::Status failure;
    std::vector<std::string> keys;  // identities that name it
    std::string digest_key;         // digest, format, block size and tensor list
    std::string source;
    StoreSpec spec;
    std::unique_ptr<SealedMemory> memory;
    std::vector<StoredTensor> tensors;
    std::string digest;
    uint64_t bytes = 0;
    std::set<StoreUser> users;
    // The uids that proved read access (Open), oldest proof first; at most max_provers.
    std::vector<uid_t> provers;
    absl::Time last_used;
    // Set when the build found a copy of this checkpoint already stored: the store to use.
    std::shared_ptr<Store> moved_to;
  };
  struct Staged {
    StoreUser user;
    std::vector<SourceFile> files;
  };
  using StorePtr = std::shared_ptr<Store>;

  // Builds `store` from `files` (outside the lock); on success it is ready and visible.
  absl::Status Build(const StorePtr& store, const std::vector<SourceFile>& files)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<OpenedStore> Describe(const Store& store, bool built) const;
  StoreStatus StatusOf(const Store& store, absl::Time now) const;
  // `uid` proved read access to `store` just now: it becomes the newest of its provers.
  void ProvedLocked(Store& store, uid_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the least recently used unused store; false when there is none. Its memory goes to
  // `dead`, to be freed once the lock is dropped.
  bool EvictOneLocked(std::vector<StorePtr>& dead) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `store` from the books (its identities and the list), charging nothing back.
  void ForgetLocked(const StorePtr& store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropLocked(const StorePtr& store, const char* reason, std::vector<StorePtr>& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The user left `store`: drop it at once when keep is zero.
  void LeftLocked(const StorePtr& store, std::vector<StorePtr>& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweeperLoop() ABSL_LOCKS_EXCLUDED(mu_);

  Ledger& ledger_;
  const StoreManagerOptions options_;
  mutable Mutex mu_;
  CondVar built_;  // a build finished (or failed)
  CondVar wake_;   // the sweeper's
  absl::Duration keep_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, StorePtr> stores_ ABSL_GUARDED_BY(mu_);        // building and ready
  std::map<std::string, StorePtr> by_key_ ABSL_GUARDED_BY(mu_);     // identity -> store
  std::map<std::string, StorePtr> by_digest_ ABSL_GUARDED_BY(mu_);  // ready stores only
  std::map<uint64_t, Staged> staged_ ABSL_GUARDED_BY(mu_);          // by session
  DeviceCopies device_copies_;  // before sweeper_: the sweeper uses it
  std::thread sweeper_;
};

}  // namespace tsd::stores
