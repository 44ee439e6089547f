// tsclient: the C++ client of the TrainStream daemon (tsd).
//
// A Client connects to a running tsd over its Unix socket, attaches to a job (creating it on
// first attach) and allocates regions of host memory that the daemon owns and keeps locked. Each
// region arrives as a file descriptor and is mapped into this process; where CUDA and a GPU are
// present it is also registered with cudaHostRegister, so copies to and from the GPU run at
// pinned speed. All methods are thread-safe and return absl::Status / absl::StatusOr: errors carry
// the daemon's message (what was wrong, what is available).
//
//   auto client = tsd::Client::Connect();           // $TSD_SOCKET, else the default socket
//   RETURN_IF_ERROR((*client)->Attach("my-job", 8ull << 30));
//   auto region = (*client)->Alloc("grads", 1 << 20);  // mapped, read-write
//   std::memset((*region)->data(), 0, (*region)->size());
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace tsd {

class Optimizer;
struct OptimizerSpec;

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
};

// One job, as `Client::Jobs` reports it.
struct JobStatus {
  std::string name;
  uint32_t uid = 0;
  uint32_t sessions = 0;
  uint64_t used_bytes = 0;
  uint64_t quota_bytes = 0;
  uint32_t regions = 0;
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

  const std::string& socket_path() const { return socket_path_; }
  bool attached() const;
  std::string job() const;
  uint64_t quota_bytes() const;
  uint64_t session_id() const;

 private:
  struct Impl;
  explicit Client(std::string socket_path);
  absl::StatusOr<std::shared_ptr<Region>> FetchAndMap(uint64_t region_id);
  friend class Optimizer;
  // Sends a state request with `fd` on the side socket; returns the bytes the daemon moved.
  absl::StatusOr<uint64_t> StateRequest(bool save, int fd);
  // False once the daemon closed the session's side connection (it died or shut down).
  bool DaemonAlive(std::string* why);

  const std::string socket_path_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tsd
