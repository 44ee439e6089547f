// tsclient: the C++ client of the TrainStream daemon (tsd).
//
// A Client connects to a running tsd over its Unix socket, attaches to a job (creating it on
// first attach) and allocates regions of host memory that the daemon owns and keeps locked. Each
// region arrives as a file descriptor and is mapped into this process; where CUDA and a GPU are
// present it is also registered with cudaHostRegister, so copies to and from the GPU run at
// pinned speed. All methods are thread-safe and return absl::Status / absl::StatusOr: errors carry
// the daemon's message (what was wrong, what is available).
//
// A session is one connection to tsd's side socket, where the daemon learns this process's uid
// from the kernel; every call of the session travels on it, one at a time, each with a request
// id its reply must echo. A request that gets no reply within the request timeout closes the
// connection, which ends the session (the daemon releases the job with its last session): the
// client never reads a late reply as the answer to a later request. The daemon may send a notice
// (it is shutting down, or it closed the session and why); `LastNotice()` keeps the last one.
//
//   auto client = tsd::Client::Connect();           // $TSD_SOCKET, else the default socket
//   RETURN_IF_ERROR((*client)->Attach("my-job", 8ull << 30));
//   auto region = (*client)->Alloc("grads", 1 << 20);  // mapped, read-write
//   std::memset((*region)->data(), 0, (*region)->size());
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <optional>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tsd/device_store.h"
#include "tsd/store.h"

namespace tsd {

class Optimizer;
struct OptimizerSpec;
struct ResumeReport;

// What an attach asks beyond the job and its quota (docs/daemon.md, "Kept jobs and resuming").
struct JobOptions {
  // Keep the job (regions, optimizer state, quota charge) this long after its last session dies
  // rather than detaches; 0: the daemon's orphan_grace. At most the daemon's max_keep_for.
  absl::Duration keep_for = absl::ZeroDuration();
  // Continue an existing job (one kept after its trainer died): NOT_FOUND when there is none.
  bool resume = false;
};

// The daemon's pool, as `Client::Status` reports it.
struct PoolStatus {
  std::string version;
  double uptime_s = 0;
  uint64_t pool_bytes = 0;
  uint64_t used_bytes = 0;
  bool locked = false;
  uint32_t jobs = 0;
  uint32_t sessions = 0;
  uint64_t max_job_quota_bytes = 0;
  uint32_t pid = 0;
  uint32_t protocol_version = 0;  // of the daemon's side-socket protocol (0: older than 2)
};

// One job, as `Client::Jobs` reports it.
struct JobStatus {
  std::string name;
  uint32_t uid = 0;
  uint32_t sessions = 0;
  uint64_t used_bytes = 0;
  uint64_t quota_bytes = 0;
  uint32_t regions = 0;
  int numa_node = -1;  // the NUMA node tsd placed the job on (-1: none)
  // What the job's optimizer is doing (`tsctl top`); see JobActivity in tsd.proto.
  struct Activity {
    uint64_t steps = 0, params = 0, params_updated = 0, bucket_updates = 0;
    double steps_per_s = 0, params_per_s = 0;
    double bucket_update_p50_s = 0, bucket_update_p99_s = 0;
    std::string moment_dtype;  // "F32" or "BF16"
    // The client's report of its last step (client_reports == 0: it never reported).
    uint64_t client_reports = 0;
    double client_step_wait_s = 0;
    uint64_t client_h2d_bytes = 0, client_d2h_bytes = 0;
    // Clipping: commits applied before they were asked (speculated), and those redone.
    uint64_t speculated_commits = 0, redone_commits = 0;
    // Seconds tsd's optimizer threads spent on the job's bucket work, all threads together.
    double work_busy_s = 0;
    // Its share of those threads' time lately (over the span of steps_per_s; 0 to 1).
    double work_busy_share = 0;
  };
  bool has_optimizer = false;
  Activity activity;
};

// Something tsd said on its own initiative on the session's connection.
struct Notice {
  enum class Kind { kShutdown, kSessionClosed, kOther };
  Kind kind = Kind::kOther;
  std::string message;
};

// A region's identity without a mapping.
struct RegionDesc {
  uint64_t id = 0;
  std::string name;
  uint64_t size = 0;
  bool locked = false;
};

// A region mapped into this process. It stays mapped until it is freed through the client or the
// last reference goes away (which unmaps it but does not free it in the daemon: other sessions of
// the job may still use it).
class Region final {
 public:
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  uint64_t id() const { return desc_.id; }
  const std::string& name() const { return desc_.name; }
  uint64_t size() const { return desc_.size; }
  bool locked() const { return desc_.locked; }
  // The mapping (nullptr once freed).
  void* data() const { return data_; }
  // The region's memfd in this process (-1 once freed).
  int fd() const { return fd_; }
  // Registered with CUDA (cudaHostRegister) in this process.
  bool cuda_registered() const { return cuda_registered_; }
  // Unregisters it from CUDA (it stays mapped; copies to and from it become pageable ones), so
  // that pages the daemon punches out of it really return to the kernel. Idempotent.
  void Unpin();

 private:
  friend class Client;
  Region(RegionDesc desc, int fd) : desc_(std::move(desc)), fd_(fd) {}
  // Unregisters, unmaps and closes; safe to call twice.
  void Unmap();

  RegionDesc desc_;
  int fd_ = -1;
  void* data_ = nullptr;
  bool cuda_registered_ = false;
};

// What registering an optimizer would allocate, from `Client::PlanOptimizer` (a dry run). Sizes
// are page-rounded, as the daemon charges them; `state_bytes` is their sum, with the moments
// counted twice (exp_avg and exp_avg_sq).
struct OptimizerLayout {
  struct Bucket {
    uint64_t master_offset = 0, grad_offset = 0, param_offset = 0;
  };
  std::vector<Bucket> buckets;
  uint64_t state_bytes = 0;
  uint64_t control_bytes = 0, master_bytes = 0, moment_bytes = 0, grad_bytes = 0, param_bytes = 0,
           accum_bytes = 0;
  // fp32 parameters: their slots are the masters (param_offset into "opt/master", param_bytes 0).
  bool params_in_master = false;
};

class Client final {
 public:
  // Connects to tsd at `socket_path`; empty means $TSD_SOCKET, then the default
  // (/run/tsd/tsd.sock for root, else $XDG_RUNTIME_DIR/tsd/tsd.sock or /tmp/tsd-$UID/tsd.sock).
  // With no daemon there: UNAVAILABLE, naming the path tried and how to start tsd.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& socket_path = "");
  ~Client();  // detaches when attached
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Joins or creates `job`. `quota_bytes` 0 asks for the daemon's maximum; the granted quota is
  // `quota_bytes()` afterwards. One client holds at most one session.
  absl::Status Attach(const std::string& job, uint64_t quota_bytes = 0);
  // The same, keeping the job after a crash or resuming a kept one (`options`).
  absl::Status Attach(const std::string& job, uint64_t quota_bytes, const JobOptions& options);
  // After a resume attach: takes over the job's kept optimizer, which must match `spec` (the
  // same buckets, groups, dtypes and options; else FAILED_PRECONDITION naming the difference),
  // once tsd settled what the dead trainer left in flight; `report` (may be null) says where
  // each bucket stands. Nothing is allocated. Data parallel: `spec.rank` and `spec.world` as the
  // rank registered them; every rank of the restarted group resumes, and all get the same report.
  absl::StatusOr<std::unique_ptr<Optimizer>> ResumeOptimizer(const OptimizerSpec& spec,
                                                             ResumeReport* report);
  // Writes the optimizer state of `job` (the caller's uid's) into `fd`, a regular file this
  // process opened for writing, with a checksum of every tensor (`tsctl checkpoint`). Uses a
  // connection of its own; this client need not be attached.
  absl::StatusOr<uint64_t> Checkpoint(const std::string& job, int fd);
  // How long the attached job is kept after its last session dies, and whether this session
  // resumed it and how long it had been without a session.
  absl::Duration keep_for() const;
  bool resumed() const;
  double orphaned_s() const;
  // Ends the session; the job is released with its last session.
  absl::Status Detach();
  // Allocates a region of at least `bytes` (rounded up to pages) and maps it.
  absl::StatusOr<std::shared_ptr<Region>> Alloc(const std::string& name, uint64_t bytes);
  // Maps an existing region of the job by name (e.g. one another session allocated).
  absl::StatusOr<std::shared_ptr<Region>> Map(const std::string& name);
  // Frees a region in the daemon and unmaps it here.
  absl::Status Free(const std::shared_ptr<Region>& region);
  absl::StatusOr<std::vector<RegionDesc>> ListRegions();
  absl::StatusOr<PoolStatus> Status();
  // Sets up the job's optimizer engine in the daemon and maps its slots (see tsd/optimizer.h).
  // The Optimizer must not outlive this Client.
  absl::StatusOr<std::unique_ptr<Optimizer>> RegisterOptimizer(const OptimizerSpec& spec);
  // A dry run of RegisterOptimizer: the daemon checks `spec` as registration does and returns
  // the layout and the bytes it would charge, allocating nothing. Needs no session.
  absl::StatusOr<OptimizerLayout> PlanOptimizer(const OptimizerSpec& spec);
  absl::StatusOr<std::vector<JobStatus>> Jobs();

  // --- Weight stores (tsd/store.h, docs/stores.md) ---
  // Opens the store of the safetensors checkpoint `files` (opened here, read-only, and sent to
  // tsd as descriptors) in the form `spec` asks for: tsd finds it, or builds it, and the job
  // counts among its users until CloseStore or its release. The view maps it read-only.
  absl::StatusOr<std::shared_ptr<StoreView>> OpenStore(const std::vector<std::string>& files,
                                                       const StoreSpec& spec);
  // The same with descriptors this process opened (they stay open and owned by the caller).
  absl::StatusOr<std::shared_ptr<StoreView>> OpenStoreFds(const std::vector<int>& fds,
                                                          const StoreSpec& spec);
  // The job stops using store `store_id` (the store is kept warm for store_keep, then dropped).
  absl::Status CloseStore(uint64_t store_id);
  // The device copy of store `store_id` (opened with OpenStore) on the GPU `gpu_uuid`, mapped here
  // (tsd/device_store.h); tsd must run with gpu_stores = true.
  absl::StatusOr<std::shared_ptr<DeviceStoreView>> OpenDeviceStore(uint64_t store_id,
                                                                   const std::string& gpu_uuid);
  // The stores this process's uid may see (those it proved read access to by opening them; every
  // store for tsd's own uid) and the node's totals (tsd/store.h). Metadata only; needs no
  // session: an attached client asks on its session, another on a connection of its own.
  absl::StatusOr<StoreListing> ListStores();
  // ListStores()'s stores.
  absl::StatusOr<std::vector<StoreStatus>> Stores();

  // How long a request of the session waits for its reply (default 120 s; saving and loading
  // optimizer state wait at least an hour). A request that times out ends the session.
  void SetRequestTimeout(absl::Duration timeout);
  // The last notice tsd sent this client (a shutdown, or why it closed the session), if any;
  // reads one that arrived while the client was idle.
  std::optional<Notice> LastNotice() const;

  const std::string& socket_path() const { return socket_path_; }
  bool attached() const;
  std::string job() const;
  uint64_t quota_bytes() const;
  uint64_t session_id() const;

 private:
  struct Impl;
  explicit Client(std::string socket_path);
  absl::StatusOr<std::shared_ptr<Region>> FetchAndMap(uint64_t region_id);
  // RegisterOptimizer and ResumeOptimizer.
  absl::StatusOr<std::unique_ptr<Optimizer>> Register(const OptimizerSpec& spec, bool resume,
                                                      ResumeReport* report);
  friend class Optimizer;
  // Sends a state request with `fd` on the side socket; returns the bytes the daemon moved.
  absl::StatusOr<uint64_t> StateRequest(bool save, int fd, absl::Span<const uint32_t> buckets = {});
  // Optimizer::RetireBuckets: the request and its reply (released bytes, retired count).
  absl::StatusOr<std::pair<uint64_t, uint32_t>> RetireRequest(absl::Span<const uint32_t> buckets,
                                                              bool masters_unpinned);
  // False once the daemon closed the session's side connection (it died or shut down).
  bool DaemonAlive(std::string* why);

  const std::string socket_path_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tsd
