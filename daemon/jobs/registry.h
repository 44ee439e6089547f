// The Registry is the daemon's book of jobs, sessions and regions. It counts no bytes itself: every
// charge of a region (a client's or the optimizer's) goes through the node's Ledger
// (daemon/memory/ledger.h), which holds the pool, each job's quota and the store budget, and whose
// refusals name the biggest holders. Every request from a client ends up here, already parsed
// but not trusted: each id, name and size is checked, and a request that fails changes nothing.
//
// A session is one side-socket connection (daemon/rpc/side_server.h): `Attach` is called with the
// uid and pid the kernel reported for that connection and returns the session's id, which only
// the side server knows and passes back with each later request of that connection. There is no
// token to steal: a session's calls can only come from its own connection. Only the uid that
// created a job may attach to it. A job lives while it has sessions; when the last one ends its
// memory is released after the orphan grace period.
//
// Locking: one mutex guards all state; the Ledger's own lock is taken inside it, never the other
// way round. Creating a region's memory (slow: pages are allocated and locked) happens outside
// it, between a Ledger reservation and its commit, so other clients are never stalled behind a
// large allocation.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/memory/ledger.h"
#include "daemon/memory/numa_topology.h"
#include "daemon/memory/region.h"
#include "daemon/optimizer/job_optimizer.h"
#include "daemon/optimizer/worker_pool.h"
#include "proto/mutex.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"

namespace tsd {

struct JobRef;

struct RegistryOptions {
  uint64_t pool_bytes = 0;
  uint64_t max_job_quota_bytes = 0;
  bool lock_memory = false;
  absl::Duration orphan_grace = absl::ZeroDuration();
  // The longest keep_for a job may ask for (daemon/jobs/keep.cc).
  absl::Duration max_keep_for = absl::Hours(1);
  // Region budgets (daemon/ops/resource_budget.h): each region costs a descriptor and a mapping.
  size_t max_regions_per_job = 65536;
  size_t max_regions_per_uid = 65536;
  size_t max_regions = 65536;  // every job together
  size_t max_jobs = 4096;
  WorkerPool* pool = nullptr;  // the optimizer engine's threads (required for RegisterOptimizer)
  OptimizerObservers* metrics = nullptr;  // what optimizers report to (may be null)
  kernels::Isa isa = kernels::Isa::kScalar;
  // The host's NUMA nodes (not owned; may be null). With two nodes or more, a job whose GPU is
  // known (PlaceJob) gets its new regions on that GPU's node.
  const NumaTopology* numa = nullptr;
  // The node's ledger, shared with the stores (not owned; it must outlive the Registry). Null:
  // the Registry keeps a ledger of its own, of pool_bytes and no store budget.
  Ledger* ledger = nullptr;
  // Told when a job is released (under the Registry's lock: it must not call the Registry), so
  // the stores can stop counting it as a user. May be empty.
  std::function<void(const JobRef& job)> on_job_released;
  // Asked, when a region does not fit, to free at least `bytes` of the pool (by evicting unused
  // stores); returns the bytes it freed. Called under the Registry's lock. May be empty.
  std::function<uint64_t(uint64_t bytes)> make_room;
};

// Why a session ended or a job (or some of its regions) was released: logged as `reason=`.
enum class ReleaseReason {
  kDetach,                  // the session asked (a job goes at once, whatever orphan_grace says)
  kDisconnected,            // the session's connection closed
  kOptimizerFailed,         // the job's optimizer found a protocol violation on its page
  kOrphanGraceExpired,      // the job had no session for orphan_grace
  kShutdown,                // the daemon is stopping
  kRegistrationRolledBack,  // an optimizer registration failed half-way (its regions only)
};
const char* ReleaseReasonName(ReleaseReason reason);

// A job as a multi-step operation sees it: a job re-created under the same name is another one.
struct JobRef {
  std::string name;
  uint64_t instance = 0;
};

// What an attach asks beyond the job and quota (daemon/jobs/keep.cc).
struct AttachOptions {
  // Keep the job this long after its last session dies (0: orphan_grace); <= max_keep_for.
  absl::Duration keep_for = absl::ZeroDuration();
  // Continue an existing (kept) job; it must exist.
  bool resume = false;
};

struct AttachResult {
  uint64_t session_id = 0;
  std::string job;
  uint64_t quota_bytes = 0;
  bool job_created = false;
  absl::Duration keep_for = absl::ZeroDuration();
  bool resumed = false;
  absl::Duration orphaned_for = absl::ZeroDuration();  // resumed: how long it had no session
};

// A session the registry ended on its own (Sweep), and why, so its connection can be told.
struct ClosedSession {
  uint64_t session_id = 0;
  std::string reason;
};

// A descriptor handed out for a region: the caller owns `fd` (a dup of the region's memfd).
struct RegionFd {
  int fd = -1;
  v1::RegionInfo info;
};

struct PoolSnapshot {
  uint64_t pool_bytes = 0;
  uint64_t used_bytes = 0;
  uint32_t jobs = 0;
  uint32_t sessions = 0;
};

class Registry final {
 public:
  explicit Registry(RegistryOptions options);
  ~Registry();

  // Starts a session of `job` for the caller `uid`/`pid` (from SO_PEERCRED), creating the job on
  // first attach. Another uid's job is refused with PERMISSION_DENIED and changes nothing.
  absl::StatusOr<AttachResult> Attach(const std::string& job, uint64_t quota_bytes, uid_t uid,
                                      pid_t pid, const AttachOptions& extra = {});
  absl::StatusOr<v1::RegionInfo> Alloc(uint64_t session_id, const std::string& name,
                                       uint64_t size_bytes);
  absl::StatusOr<uint64_t> Free(uint64_t session_id, uint64_t region_id);
  absl::StatusOr<std::vector<v1::RegionInfo>> ListRegions(uint64_t session_id);
  // Ends a session on request; true when its job was released with it.
  absl::StatusOr<bool> Detach(uint64_t session_id);
  // --- Optimizer registration (driven by daemon/optimizer/registrar.h) ------------------------
  // The session's job, when it has no optimizer yet and `need_bytes` fit in its quota.
  absl::StatusOr<JobRef> PrepareOptimizer(uint64_t session_id, uint64_t need_bytes);
  // Allocates one of the optimizer's own regions ("opt/" names, which clients may not use) in the
  // session's job.
  absl::StatusOr<v1::RegionInfo> AllocOptimizerRegion(uint64_t session_id, const std::string& name,
                                                      uint64_t size_bytes);
  // Frees `region_ids` of `job`, whether or not a session of it is still alive (the rollback of a
  // registration whose session died half-way). Ids not in the job, or a job that is gone (and
  // took its regions with it), are skipped. Returns the bytes released.
  uint64_t ReleaseRegions(const JobRef& job, const std::vector<uint64_t>& region_ids,
                          ReleaseReason why);
  // Builds the job's optimizer with `make`, from the regions `region_ids` (in that order), and
  // installs it; the session that registered it is closed if it fails. Called under the lock, so
  // no other session sees the job half set up.
  using OptimizerFactory = std::function<absl::StatusOr<std::shared_ptr<JobOptimizer>>(
      const std::string& job, const std::vector<std::shared_ptr<Region>>& regions)>;
  // `rank` (>= 0): the data-parallel rank the registering session holds (world > 1).
  absl::Status InstallOptimizer(uint64_t session_id, const JobRef& job,
                                const std::vector<uint64_t>& region_ids,
                                const OptimizerFactory& make, int64_t rank = -1);
  // Data parallel (daemon/jobs/ranks.cc): makes `session_id` rank `rank` of its job's optimizer,
  // registered for `world` ranks, after `check(its plan)` accepts the session's request.
  // NOT_FOUND when the job has no optimizer yet (the caller creates it); FAILED_PRECONDITION for
  // an optimizer that failed, or one of another world (or of none); ALREADY_EXISTS for a rank a
  // live session holds, or a session that already holds one. Changes nothing when refused.
  absl::StatusOr<std::shared_ptr<JobOptimizer>> JoinOptimizer(
      uint64_t session_id, uint32_t rank, uint32_t world,
      const std::function<absl::Status(const OptimizerPlan&)>& check);
  // Places the session's job on the NUMA node of the GPU at `pci_bus_id` (as the client sent it),
  // unless the job is placed already (the first GPU named decides). Returns the job's node (-1:
  // none). INVALID_ARGUMENT for a malformed address, changing nothing; on a host of one node, or
  // when sysfs does not know the device (logged, with why), the job stays unplaced.
  absl::StatusOr<int> PlaceJob(uint64_t session_id, const std::string& pci_bus_id);
  // --- end of optimizer registration -----------------------------------------------------------
  // --- Kept jobs (daemon/jobs/keep.cc) ----------------------------------------------------------
  // The job's optimizer, for a session that attached with resume, after `check(kept plan)`
  // accepts it; the session becomes the one told when the optimizer fails.
  absl::StatusOr<std::shared_ptr<JobOptimizer>> TakeOverOptimizer(
      uint64_t session_id, const std::function<absl::Status(const OptimizerPlan&)>& check);
  // Data parallel: makes `session_id` rank `rank` of a restarted group resuming its job's kept
  // optimizer, registered for `world` ranks, after `check(kept plan)` accepts it. The job must
  // have been kept (keep_for) and its optimizer stopped only because a rank was lost (a protocol
  // violation is not resumable); the world must be the kept one's; every rank of the group that
  // was lost must have ended. The first rank of the group starts a GroupResume, the others join
  // it; each then settles through it (GroupResume::Settle). Changes nothing when refused.
  struct RankTakeOver {
    std::shared_ptr<JobOptimizer> optimizer;
    std::shared_ptr<GroupResume> group;
  };
  absl::StatusOr<RankTakeOver> TakeOverRank(
      uint64_t session_id, uint32_t rank, uint32_t world,
      const std::function<absl::Status(const OptimizerPlan&)>& check);
  // The optimizer of `job` for a checkpoint asked by `uid` (with no session): NOT_FOUND without
  // one, PERMISSION_DENIED for another uid's job.
  absl::StatusOr<std::shared_ptr<JobOptimizer>> OptimizerForCheckpoint(const std::string& job,
                                                                       uid_t uid);
  // --- end of kept jobs --------------------------------------------------------------------------
  // Retires buckets of the session's optimizer (JobOptimizer::RetireBuckets: their optimizer
  // moved to the trainer's GPU share) and lowers the job's charge by the memory that returned to
  // the kernel (daemon/jobs/retire.cc). Returns the bytes released. The punching runs without
  // the Registry's lock (it can take a while for many GiB).
  struct Retired {
    uint64_t released_bytes = 0;
    uint32_t retired = 0;  // the optimizer's retired buckets, these included
  };
  absl::StatusOr<Retired> RetireBuckets(uint64_t session_id, absl::Span<const uint32_t> buckets,
                                        bool masters_unpinned = false) ABSL_LOCKS_EXCLUDED(mu_);
  // The job of a session (NOT_FOUND when the session has ended).
  absl::StatusOr<JobRef> SessionJob(uint64_t session_id);
  // The optimizer of a session's job (NOT_FOUND when there is none).
  absl::StatusOr<std::shared_ptr<JobOptimizer>> OptimizerOf(uint64_t session_id);
  // A dup of a region's memfd, for a session of the region's job.
  absl::StatusOr<RegionFd> GetFd(uint64_t session_id, uint64_t region_id);
  // The session's side connection closed (the process exited or was killed). Idempotent.
  void SessionDisconnected(uint64_t session_id);
  // Ends a session for `why` (logged); its job is released with its last session. Idempotent.
  void EndSession(uint64_t session_id, ReleaseReason why);
  // Releases jobs orphaned for longer than the grace period, and returns the sessions whose
  // optimizer failed, with the failure, each once: the caller tells each connection why, then
  // ends the session (EndSession), so the client reads the reason before anything else fails.
  std::vector<ClosedSession> Sweep(absl::Time now);
  // Releases every job (shutdown).
  void ReleaseAll();

  PoolSnapshot Snapshot() const;
  std::vector<v1::JobInfo> Jobs() const;

  // --- Live reload and metrics (daemon/ops/reload.cc, daemon/ops/metrics.cc)
  // --------------------------- A copy: pool_bytes, max_job_quota_bytes and orphan_grace may change
  // (Reconfigure).
  RegistryOptions options() const;
  // Applies a reloaded configuration, all or nothing. A pool smaller than what jobs hold now is
  // refused (the message says how much is held, and by whom) and nothing changes. Jobs keep the
  // quotas they were granted; `max_job_quota_bytes` caps jobs created from now on.
  absl::Status Reconfigure(uint64_t pool_bytes, uint64_t max_job_quota_bytes,
                           absl::Duration orphan_grace);
  // Everything the metrics endpoint shows, taken under one lock so its figures agree.
  struct MetricsView {
    PoolSnapshot pool;
    uint64_t max_job_quota_bytes = 0;
    uint64_t locked_bytes = 0;  // bytes of committed regions that are mlock()ed
    std::vector<v1::JobInfo> jobs;
  };
  MetricsView View() const;
  // --- end of live reload and metrics ----------------------------------------------------------
  // The ledger every charge goes through.
  Ledger& ledger() const { return *ledger_; }

 private:
  struct Session {
    uint64_t id = 0;
    std::string job;
    uid_t uid = 0;
    pid_t pid = 0;
  };
  struct Job {
    uint64_t instance = 0;  // distinguishes a re-created job of the same name
    std::string name;
    uid_t uid = 0;
    uint64_t quota_bytes = 0;  // as granted; the Ledger holds it and what the job uses
    std::map<uint64_t, std::shared_ptr<Region>> regions;
    std::set<std::string> names;  // of regions, including allocations in flight
    std::set<uint64_t> sessions;
    std::optional<absl::Time> orphaned_since;
    absl::Duration keep_for = absl::ZeroDuration();  // asked at attach (AttachOptions)
    std::shared_ptr<JobOptimizer> optimizer;
    uint64_t optimizer_session = 0;  // the session that registered it (closed if it fails)
    // Data parallel: the session holding each rank of the optimizer. A rank's session that ends
    // other than by Detach fails the optimizer for the others (RemoveSessionLocked).
    std::map<uint32_t, uint64_t> ranks;
    // Data parallel: the resume of the group that took the optimizer over after a rank was lost
    // (TakeOverRank); null while the group that registered it (or none) drives it. Reset when a
    // rank is lost again.
    std::shared_ptr<GroupResume> group_resume;
    int numa_node = -1;  // where its regions go (PlaceJob); -1: anywhere
  };
  // What a release leaves to destroy once the lock is dropped: optimizers first (they stop their
  // threads), then the regions they worked in.
  struct Released {
    std::vector<std::shared_ptr<Region>> regions;
    std::vector<std::shared_ptr<JobOptimizer>> optimizers;
    ~Released() { optimizers.clear(); }
  };

  // Finds a session (NOT_FOUND, saying so, when it ended). Needs mu_.
  absl::StatusOr<Session*> FindSession(uint64_t session_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a job, uncharging the pool; its regions are moved to `dead` to be destroyed after
  // the lock is dropped.
  void ReleaseJobLocked(const std::string& name, ReleaseReason why, Released& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Refuses `rank` for `session_id` when the session already holds a rank of `job` or another
  // session holds `rank`; `how` ("register", "resume") names what every rank must do once.
  static absl::Status CheckRankFree(const Job& job, uint64_t session_id, uint32_t rank,
                                    absl::string_view how);
  // A data-parallel rank's session ended: forgets its rank, and fails the job's optimizer (every
  // other rank's wait then reports why) unless it detached.
  void RankEndedLocked(Job& job, uint64_t session_id, ReleaseReason why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes a session; releases its job when it was the last and the grace period is zero.
  void RemoveSessionLocked(uint64_t session_id, ReleaseReason why, Released& dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Alloc for the optimizer's own regions ("opt/..." names, which clients may not use).
  absl::StatusOr<v1::RegionInfo> AllocInternal(uint64_t session_id, const std::string& name,
                                               uint64_t size_bytes);
  // Refuses a new region of `job` beyond the per-job, per-uid or node region budget.
  absl::Status CheckRegionBudgetLocked(const Job& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How long `job` is kept once it has no session: its keep_for, else orphan_grace.
  absl::Duration GraceLocked(const Job& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Checks an attach's AttachOptions against `existing` (null: the job would be created).
  absl::Status CheckAttachOptionsLocked(const std::string& job, const Job* existing,
                                        const AttachOptions& extra) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static v1::RegionInfo Describe(const Region& r);
  v1::JobInfo DescribeJob(const std::string& name, const Job& job) const;

  // Fixed at construction, except pool_bytes, max_job_quota_bytes and orphan_grace, which
  // Reconfigure changes under mu_ (read them under mu_ too).
  RegistryOptions options_ ABSL_GUARDED_BY(mu_);
  mutable Mutex mu_;
  std::unique_ptr<Ledger> own_ledger_;  // when options.ledger is null
  Ledger* const ledger_;
  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_region_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_job_instance_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Session> sessions_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Job> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tsd
