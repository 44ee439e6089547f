#include "daemon/jobs/registry.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

using wire::FormatBytes;

uint64_t RoundUpToPage(uint64_t bytes) {
  return (bytes + wire::kPageBytes - 1) / wire::kPageBytes * wire::kPageBytes;
}

}  // namespace

Registry::Registry(RegistryOptions options)
    : options_(options),
      own_ledger_(options.ledger != nullptr ? nullptr
                                            : std::make_unique<Ledger>(options.pool_bytes, 0)),
      ledger_(options.ledger != nullptr ? options.ledger : own_ledger_.get()) {}

Registry::~Registry() { ReleaseAll(); }

v1::JobInfo Registry::DescribeJob(const std::string& name, const Job& job) const {
  v1::JobInfo info;
  info.set_name(name);
  info.set_uid(job.uid);
  info.set_sessions(static_cast<uint32_t>(job.sessions.size()));
  info.set_used_bytes(ledger_->Held(Holder::Job(name)));
  info.set_quota_bytes(job.quota_bytes);
  info.set_regions(static_cast<uint32_t>(job.regions.size()));
  if (job.numa_node >= 0) info.set_numa_node(job.numa_node);
  if (job.optimizer) job.optimizer->DescribeActivity(*info.mutable_activity());
  return info;
}

v1::RegionInfo Registry::Describe(const Region& r) {
  v1::RegionInfo info;
  info.set_region_id(r.id());
  info.set_name(r.name());
  info.set_size_bytes(r.bytes());
  info.set_kind(v1::MEMFD);
  info.set_locked(r.locked());
  return info;
}

absl::StatusOr<AttachResult> Registry::Attach(const std::string& job, uint64_t quota_bytes,
                                              uid_t uid, pid_t pid, const AttachOptions& extra) {
  TSD_RETURN_IF_ERROR(wire::ValidateName("job", job));
  MutexLock lock(mu_);
  AttachResult result;
  result.job = job;
  auto it = jobs_.find(job);
  if (it != jobs_.end() && it->second.uid != uid) {
    return absl::PermissionDeniedError(
        absl::StrCat("job '", job, "' belongs to uid ", it->second.uid, "; uid ", uid,
                     " may not attach to it (pick another job name)"));
  }
  TSD_RETURN_IF_ERROR(
      CheckAttachOptionsLocked(job, it == jobs_.end() ? nullptr : &it->second, extra));
  if (it == jobs_.end()) {
    if (jobs_.size() >= options_.max_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the daemon holds ", jobs_.size(), " jobs, its limit; detach unused jobs first"));
    }
    const uint64_t asked = quota_bytes == 0 ? options_.max_job_quota_bytes : quota_bytes;
    Job j;
    j.instance = next_job_instance_++;
    j.name = job;
    j.uid = uid;
    j.quota_bytes = std::min(asked, options_.max_job_quota_bytes);
    TSD_RETURN_IF_ERROR(ledger_->OpenJob(job, j.quota_bytes));
    it = jobs_.emplace(j.name, std::move(j)).first;
    result.job_created = true;
    spdlog::info("event=job_created job={} uid={} quota_bytes={}", job, uid,
                 it->second.quota_bytes);
  }
  Session s;
  s.id = next_session_id_++;
  s.job = job;
  s.uid = uid;
  s.pid = pid;
  result.session_id = s.id;
  sessions_.emplace(s.id, std::move(s));
  it->second.sessions.insert(result.session_id);
  if (extra.resume) {
    result.resumed = true;
    if (it->second.orphaned_since) result.orphaned_for = absl::Now() - *it->second.orphaned_since;
  }
  if (extra.keep_for > absl::ZeroDuration()) it->second.keep_for = extra.keep_for;
  it->second.orphaned_since.reset();
  result.keep_for = GraceLocked(it->second);
  result.quota_bytes = it->second.quota_bytes;
  spdlog::info("event=session_attached job={} session={} uid={} pid={}", job, result.session_id,
               uid, pid);
  return result;
}

absl::StatusOr<Registry::Session*> Registry::FindSession(uint64_t session_id) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "session ", session_id, " has ended (detached, or closed by tsd); attach again"));
  }
  return &it->second;
}

absl::Status Registry::CheckRegionBudgetLocked(const Job& job) const {
  size_t of_uid = 0, total = 0;
  for (const auto& [name, j] : jobs_) {
    total += j.names.size();
    if (j.uid == job.uid) of_uid += j.names.size();
  }
  const char* budget = nullptr;
  size_t held = 0, limit = 0;
  if (job.names.size() >= options_.max_regions_per_job) {
    budget = "max_regions_per_job";
    held = job.names.size();
    limit = options_.max_regions_per_job;
  } else if (of_uid >= options_.max_regions_per_uid) {
    budget = "max_regions_per_uid";
    held = of_uid;
    limit = options_.max_regions_per_uid;
  } else if (total >= options_.max_regions) {
    budget = "the node's region budget";
    held = total;
    limit = options_.max_regions;
  } else {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "job '", job.name, "' (uid ", job.uid, ") may not hold another region: ", budget, " is ",
      limit, " and ", held,
      " are held. Each region costs tsd a descriptor and a memory mapping, so their number is "
      "budgeted apart from bytes; free regions you no longer need, or allocate fewer, larger "
      "regions and place several buffers in each (an administrator can change max_regions_per_job "
      "and max_regions_per_uid in tsd.toml, up to the node budget tsd derives from its limits)"));
}

absl::StatusOr<v1::RegionInfo> Registry::Alloc(uint64_t session_id, const std::string& name,
                                               uint64_t size_bytes) {
  if (absl::Status s = wire::ValidateName("region", name); !s.ok()) return s;
  if (name.rfind("opt/", 0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("region name '", name,
                                                   "': names starting with 'opt/' are "
                                                   "reserved for the optimizer engine"));
  }
  return AllocInternal(session_id, name, size_bytes);
}

absl::StatusOr<v1::RegionInfo> Registry::AllocInternal(uint64_t session_id, const std::string& name,
                                                       uint64_t size_bytes) {
  uint64_t bytes = 0, region_id = 0, instance = 0;
  std::string job_name;
  bool lock_memory = false;
  int numa_node = -1;
  Reservation reserved;  // counted in the ledger at once, committed once the memory exists
  {
    MutexLock lock(mu_);
    lock_memory = options_.lock_memory;
    auto session = FindSession(session_id);
    if (!session.ok()) return session.status();
    Job& job = jobs_.at((*session)->job);
    if (size_bytes == 0) {
      return absl::InvalidArgumentError("region size is 0 bytes; ask for at least 1 byte");
    }
    if (size_bytes > options_.pool_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("region '", name, "' asks ", size_bytes, " bytes (", FormatBytes(size_bytes),
                       "), more than the whole pool of ", FormatBytes(options_.pool_bytes)));
    }
    bytes = RoundUpToPage(size_bytes);
    if (job.names.count(name) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("job '", job.name,
                                                   "' already has a region named '", name,
                                                   "'; free it or pick another name"));
    }
    TSD_RETURN_IF_ERROR(CheckRegionBudgetLocked(job));
    // The quota and the pool: the ledger refuses, naming the biggest holders.
    auto got = ledger_->Reserve(Holder::Job(job.name), name, bytes);
    if (got.status().code() == absl::StatusCode::kResourceExhausted && options_.make_room &&
        options_.make_room(bytes) > 0) {
      got = ledger_->Reserve(Holder::Job(job.name), name, bytes);  // unused stores were evicted
    }
    TSD_ASSIGN_OR_RETURN(reserved, std::move(got));
    job.names.insert(name);
    region_id = next_region_id_++;
    instance = job.instance;
    job_name = job.name;
    numa_node = job.numa_node;
  }

  auto region = Region::Create(region_id, name, bytes, lock_memory, numa_node);
  if (region.ok() && !(*region)->numa_error().empty()) {
    spdlog::warn("event=region_not_placed job={} region={} numa_node={} error=\"{}\"", job_name,
                 name, numa_node, (*region)->numa_error());
  }

  std::shared_ptr<Region> dead;  // destroyed after the lock is dropped
  MutexLock lock(mu_);
  auto job = jobs_.find(job_name);
  if (job == jobs_.end() || job->second.instance != instance) {
    // The job was released meanwhile (its last session died); closing it in the ledger dropped
    // the reservation.
    if (region.ok()) dead = std::move(*region);
    return absl::NotFoundError(absl::StrCat("job '", job_name, "' was released while region '",
                                            name, "' was being allocated"));
  }
  if (!region.ok()) {
    ledger_->Cancel(reserved);
    job->second.names.erase(name);
    spdlog::warn("event=alloc_failed job={} region={} bytes={} error=\"{}\"", job_name, name, bytes,
                 std::string(region.status().message()));
    return region.status();
  }
  if (absl::Status s = ledger_->Commit(reserved); !s.ok()) {
    dead = std::move(*region);
    job->second.names.erase(name);
    return s;
  }
  v1::RegionInfo info = Describe(**region);
  job->second.regions.emplace(region_id, std::move(*region));
  spdlog::debug("event=alloc job={} region={} id={} bytes={}", job_name, name, region_id, bytes);
  return info;
}

absl::StatusOr<uint64_t> Registry::Free(uint64_t session_id, uint64_t region_id) {
  std::shared_ptr<Region> dead;
  uint64_t freed = 0;
  {
    MutexLock lock(mu_);
    auto session = FindSession(session_id);
    if (!session.ok()) return session.status();
    Job& job = jobs_.at((*session)->job);
    auto it = job.regions.find(region_id);
    if (it != job.regions.end() && job.optimizer && it->second->name().rfind("opt/", 0) == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("region '", it->second->name(),
                       "' belongs to the job's optimizer; it is freed with the job"));
    }
    if (it == job.regions.end()) {
      return absl::NotFoundError(absl::StrCat("region ", region_id, " does not exist in job '",
                                              job.name, "' (it holds ", job.regions.size(),
                                              " regions; see ListRegions)"));
    }
    TSD_RETURN_IF_ERROR(
        ledger_->Uncharge(Holder::Job(job.name), it->second->name(), it->second->held_bytes()));
    dead = std::move(it->second);
    job.regions.erase(it);
    freed = dead->held_bytes();
    job.names.erase(dead->name());
  }
  return freed;
}

absl::StatusOr<std::vector<v1::RegionInfo>> Registry::ListRegions(uint64_t session_id) {
  MutexLock lock(mu_);
  auto session = FindSession(session_id);
  if (!session.ok()) return session.status();
  std::vector<v1::RegionInfo> out;
  for (const auto& [id, r] : jobs_.at((*session)->job).regions) out.push_back(Describe(*r));
  return out;
}

absl::StatusOr<RegionFd> Registry::GetFd(uint64_t session_id, uint64_t region_id) {
  MutexLock lock(mu_);
  auto session = FindSession(session_id);
  if (!session.ok()) return session.status();
  const Job& job = jobs_.at((*session)->job);
  auto region = job.regions.find(region_id);
  if (region == job.regions.end()) {
    return absl::NotFoundError(absl::StrCat("region ", region_id, " does not exist in job '",
                                            job.name, "' (it holds ", job.regions.size(),
                                            " regions; see ListRegions)"));
  }
  RegionFd out;
  out.fd = fcntl(region->second->fd(), F_DUPFD_CLOEXEC, 0);
  if (out.fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the daemon could not duplicate a descriptor: ", std::strerror(errno)));
  }
  out.info = Describe(*region->second);
  return out;
}

const char* ReleaseReasonName(ReleaseReason reason) {
  switch (reason) {
    case ReleaseReason::kDetach:
      return "detach";
    case ReleaseReason::kDisconnected:
      return "disconnected";
    case ReleaseReason::kOptimizerFailed:
      return "optimizer_failed";
    case ReleaseReason::kOrphanGraceExpired:
      return "orphan_grace_expired";
    case ReleaseReason::kShutdown:
      return "shutdown";
    case ReleaseReason::kRegistrationRolledBack:
      return "registration_rolled_back";
  }
  return "unknown";
}

void Registry::ReleaseJobLocked(const std::string& name, ReleaseReason why, Released& dead) {
  auto it = jobs_.find(name);
  if (it == jobs_.end()) return;
  Job& job = it->second;
  for (uint64_t sid : job.sessions) sessions_.erase(sid);
  if (job.optimizer) dead.optimizers.push_back(std::move(job.optimizer));
  for (auto& [id, r] : job.regions) dead.regions.push_back(std::move(r));
  const absl::StatusOr<uint64_t> released = ledger_->CloseJob(name);
  if (options_.on_job_released) options_.on_job_released(JobRef{name, job.instance});
  spdlog::info("event=job_released job={} uid={} bytes={} regions={} reason={}", name, job.uid,
               released.value_or(0), job.regions.size(), ReleaseReasonName(why));
  jobs_.erase(it);
}

void Registry::RemoveSessionLocked(uint64_t session_id, ReleaseReason why, Released& dead) {
  auto it = sessions_.find(session_id);
  if (it == sessions_.end()) return;
  const std::string job_name = it->second.job;
  sessions_.erase(it);
  spdlog::info("event=session_ended job={} session={} reason={}", job_name, session_id,
               ReleaseReasonName(why));
  auto job = jobs_.find(job_name);
  if (job == jobs_.end()) return;
  job->second.sessions.erase(session_id);
  RankEndedLocked(job->second, session_id, why);
  // A job whose trainer died keeps its optimizer without a session driving it (optimizer_session
  // 0) until a resume takes it over: a resuming session that gives up (e.g. on a mismatched
  // registration) and detaches leaves a kept job kept.
  if (why != ReleaseReason::kDetach && job->second.optimizer_session == session_id) {
    job->second.optimizer_session = 0;
  }
  if (!job->second.sessions.empty()) return;
  // A data-parallel optimizer stopped because a rank was lost stays resumable: kept as well.
  const bool abandoned =
      job->second.optimizer != nullptr &&
      ((!job->second.optimizer->failed() && job->second.optimizer_session == 0) ||
       job->second.optimizer->resumable());
  if (GraceLocked(job->second) <= absl::ZeroDuration() ||
      (why == ReleaseReason::kDetach && !abandoned)) {
    ReleaseJobLocked(job_name, why, dead);
  } else {
    job->second.orphaned_since = absl::Now();
    spdlog::info("event=job_kept job={} keep_for={} reason={}", job_name,
                 absl::FormatDuration(GraceLocked(job->second)), ReleaseReasonName(why));
  }
}

absl::StatusOr<bool> Registry::Detach(uint64_t session_id) {
  Released dead;
  MutexLock lock(mu_);
  auto session = FindSession(session_id);
  if (!session.ok()) return session.status();
  const std::string job = (*session)->job;
  RemoveSessionLocked(session_id, ReleaseReason::kDetach, dead);
  const bool released = jobs_.count(job) == 0;
  return released;
}

void Registry::SessionDisconnected(uint64_t session_id) {
  EndSession(session_id, ReleaseReason::kDisconnected);
}

void Registry::EndSession(uint64_t session_id, ReleaseReason why) {
  Released dead;  // declared first: destroyed after the lock is dropped
  MutexLock lock(mu_);
  RemoveSessionLocked(session_id, why, dead);
}

std::vector<ClosedSession> Registry::Sweep(absl::Time now) {
  Released dead;
  MutexLock lock(mu_);
  std::vector<ClosedSession> closed;
  for (auto& [name, job] : jobs_) {
    // A restarted group's optimizer is stopped until its first rank revives it: not a failure.
    const bool resuming =
        job.optimizer && job.group_resume != nullptr && job.optimizer->resumable();
    if (job.optimizer && job.optimizer->failed() && !resuming && job.optimizer_session != 0 &&
        sessions_.count(job.optimizer_session) != 0) {
      closed.push_back(
          {job.optimizer_session, absl::StrCat("tsd closed this session: the optimizer of job '",
                                               name, "' stopped: ", job.optimizer->failure())});
      job.optimizer_session = 0;
    }
  }
  std::vector<std::string> orphans;
  for (const auto& [name, job] : jobs_) {
    if (job.orphaned_since && now - *job.orphaned_since >= GraceLocked(job))
      orphans.push_back(name);
  }
  for (const auto& name : orphans) ReleaseJobLocked(name, ReleaseReason::kOrphanGraceExpired, dead);
  return closed;
}

void Registry::ReleaseAll() {
  Released dead;
  MutexLock lock(mu_);
  std::vector<std::string> names;
  for (const auto& [name, job] : jobs_) names.push_back(name);
  for (const auto& name : names) ReleaseJobLocked(name, ReleaseReason::kShutdown, dead);
  sessions_.clear();
}

PoolSnapshot Registry::Snapshot() const {
  MutexLock lock(mu_);
  PoolSnapshot s;
  const LedgerView book = ledger_->View();
  s.pool_bytes = book.pool_bytes;
  s.used_bytes = book.held_bytes;
  s.jobs = static_cast<uint32_t>(jobs_.size());
  s.sessions = static_cast<uint32_t>(sessions_.size());
  return s;
}

std::vector<v1::JobInfo> Registry::Jobs() const {
  MutexLock lock(mu_);
  std::vector<v1::JobInfo> out;
  for (const auto& [name, job] : jobs_) {
    out.push_back(DescribeJob(name, job));
  }
  return out;
}

}  // namespace tsd

namespace tsd {

absl::StatusOr<JobRef> Registry::PrepareOptimizer(uint64_t session_id, uint64_t need_bytes) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  const Job& job = jobs_.at(session->job);
  if (job.optimizer) {
    return absl::AlreadyExistsError(absl::StrCat("job '", job.name, "' already has an optimizer"));
  }
  // The whole state must fit before its first region is allocated.
  if (absl::Status fits = ledger_->CheckFits(Holder::Job(job.name), "optimizer state", need_bytes);
      !fits.ok()) {
    return absl::Status(fits.code(), absl::StrCat(fits.message(), "; or use bf16 moments"));
  }
  return JobRef{job.name, job.instance};
}

absl::StatusOr<int> Registry::PlaceJob(uint64_t session_id, const std::string& pci_bus_id) {
  const NumaTopology* numa = nullptr;
  std::string job_name;
  {
    MutexLock lock(mu_);
    TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
    job_name = session->job;
    numa = options_.numa;
  }
  // Checked on every host, so a client learns of a bad address wherever it runs.
  if (!pci_bus_id.empty()) TSD_RETURN_IF_ERROR(CanonicalPciBusId(pci_bus_id).status());
  NumaPlacement where;
  if (numa != nullptr && numa->multi_node()) {
    // Reads sysfs: outside the lock.
    TSD_ASSIGN_OR_RETURN(where, numa->PlaceDevice(pci_bus_id));
    if (!where.reason.empty()) {
      spdlog::warn("event=numa_not_placed job={} pci_bus_id={} reason=\"{}\"", job_name,
                   absl::CEscape(pci_bus_id), where.reason);
    }
  }
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  Job& job = jobs_.at(session->job);
  if (job.numa_node < 0 && where.node >= 0) {
    job.numa_node = where.node;
    spdlog::info("event=numa_placed job={} pci_bus_id={} numa_node={}", job.name, pci_bus_id,
                 where.node);
  }
  return job.numa_node;
}

absl::StatusOr<v1::RegionInfo> Registry::AllocOptimizerRegion(uint64_t session_id,
                                                              const std::string& name,
                                                              uint64_t size_bytes) {
  if (name.rfind("opt/", 0) != 0) {
    return absl::InternalError(absl::StrCat("optimizer region '", name, "' lacks the opt/ prefix"));
  }
  return AllocInternal(session_id, name, size_bytes);
}

uint64_t Registry::ReleaseRegions(const JobRef& ref, const std::vector<uint64_t>& region_ids,
                                  ReleaseReason why) {
  std::vector<std::shared_ptr<Region>> dead;  // destroyed after the lock is dropped
  MutexLock lock(mu_);
  auto it = jobs_.find(ref.name);
  if (it == jobs_.end() || it->second.instance != ref.instance) return 0;
  Job& job = it->second;
  uint64_t freed = 0;
  for (uint64_t id : region_ids) {
    auto r = job.regions.find(id);
    if (r == job.regions.end()) continue;
    if (absl::Status s =
            ledger_->Uncharge(Holder::Job(job.name), r->second->name(), r->second->held_bytes());
        !s.ok()) {
      spdlog::error("event=ledger_mismatch job={} region={} error=\"{}\"", job.name,
                    r->second->name(), std::string(s.message()));
    }
    freed += r->second->held_bytes();
    job.names.erase(r->second->name());
    dead.push_back(std::move(r->second));
    job.regions.erase(r);
  }
  spdlog::info("event=regions_released job={} regions={} bytes={} reason={}", ref.name, dead.size(),
               freed, ReleaseReasonName(why));
  return freed;
}

absl::Status Registry::InstallOptimizer(uint64_t session_id, const JobRef& ref,
                                        const std::vector<uint64_t>& region_ids,
                                        const OptimizerFactory& make, int64_t rank) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  Job& job = jobs_.at(session->job);
  if (job.instance != ref.instance) {
    return absl::NotFoundError(
        absl::StrCat("job '", ref.name, "' was released while its optimizer was being set up"));
  }
  if (job.optimizer) {
    return absl::AlreadyExistsError(absl::StrCat("job '", job.name, "' already has an optimizer"));
  }
  std::vector<std::shared_ptr<Region>> regions;
  for (uint64_t id : region_ids) {
    auto it = job.regions.find(id);
    if (it == job.regions.end()) {
      return absl::NotFoundError(absl::StrCat("optimizer region ", id,
                                              " vanished during registration (freed by a session "
                                              "of job '",
                                              job.name, "'?)"));
    }
    regions.push_back(it->second);
  }
  TSD_ASSIGN_OR_RETURN(job.optimizer, make(job.name, regions));
  job.optimizer_session = session_id;
  job.ranks.clear();
  if (rank >= 0) job.ranks[static_cast<uint32_t>(rank)] = session_id;
  return absl::OkStatus();
}

absl::StatusOr<JobRef> Registry::SessionJob(uint64_t session_id) {
  MutexLock lock(mu_);
  TSD_ASSIGN_OR_RETURN(Session * session, FindSession(session_id));
  return JobRef{session->job, jobs_.at(session->job).instance};
}

absl::StatusOr<std::shared_ptr<JobOptimizer>> Registry::OptimizerOf(uint64_t session_id) {
  MutexLock lock(mu_);
  auto session = FindSession(session_id);
  if (!session.ok()) return session.status();
  const Job& job = jobs_.at((*session)->job);
  if (!job.optimizer)
    return absl::NotFoundError(
        absl::StrCat("job '", job.name, "' has no optimizer; register one first"));
  return job.optimizer;
}

}  // namespace tsd

// --- Live reload and metrics (daemon/ops/reload.cc, daemon/ops/metrics.cc)
// -----------------------------
namespace tsd {

RegistryOptions Registry::options() const {
  MutexLock lock(mu_);
  return options_;
}

absl::Status Registry::Reconfigure(uint64_t pool_bytes, uint64_t max_job_quota_bytes,
                                   absl::Duration orphan_grace) {
  MutexLock lock(mu_);
  // Refused, naming the holders, below what jobs and stores hold.
  TSD_RETURN_IF_ERROR(ledger_->SetPoolBytes(pool_bytes));
  options_.pool_bytes = pool_bytes;
  options_.max_job_quota_bytes = std::min(max_job_quota_bytes, pool_bytes);
  options_.orphan_grace = orphan_grace;
  return absl::OkStatus();
}

Registry::MetricsView Registry::View() const {
  MutexLock lock(mu_);
  MetricsView v;
  const LedgerView book = ledger_->View();
  v.pool.pool_bytes = book.pool_bytes;
  v.pool.used_bytes = book.held_bytes;
  v.pool.jobs = static_cast<uint32_t>(jobs_.size());
  v.pool.sessions = static_cast<uint32_t>(sessions_.size());
  v.max_job_quota_bytes = options_.max_job_quota_bytes;
  for (const auto& [name, job] : jobs_) {
    for (const auto& [id, region] : job.regions)
      v.locked_bytes += region->locked() ? region->held_bytes() : 0;
    v.jobs.push_back(DescribeJob(name, job));
  }
  return v;
}

}  // namespace tsd
// --- end of live reload and metrics --------------------------------------------------------------
