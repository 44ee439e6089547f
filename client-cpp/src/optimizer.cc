#include "tsd/optimizer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "proto/control_page.h"
#include "proto/futex.h"
#include "proto/mutex.h"
#include "proto/status_macros.h"
#include "tsd/client.h"

namespace tsd {
namespace {

constexpr auto kSpin = std::chrono::microseconds(50);
constexpr int64_t kSliceNs = 50'000'000;  // futex waits in slices, to check the daemon is alive

wire::ControlView View(const std::shared_ptr<Region>& control, size_t groups) {
  return wire::ControlView::Of(control->data(), static_cast<uint32_t>(groups));
}

}  // namespace

size_t DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

// Commits are the one piece of state that several threads may drive: each bumps the page's commit
// counter by one and waits for it, and the daemon fails the optimizer if the counter jumps.
struct Optimizer::CommitState {
  Mutex mu;
  uint64_t commits ABSL_GUARDED_BY(mu) = 0;
  // Why the optimizer is closed for good (OK while it works): the first failure seen, kept so
  // every later call reports the same one.
  Mutex mu_closed;
  absl::Status closed ABSL_GUARDED_BY(mu_closed);
  std::atomic<bool> is_closed{false};  // closed is set (read without the lock on the hot path)
};

Optimizer::Optimizer() : commit_(std::make_unique<CommitState>()) {}

void Optimizer::ContinueCommits(uint64_t committed) {
  MutexLock lock(commit_->mu);
  commit_->commits = committed;
}
Optimizer::~Optimizer() = default;

float* Optimizer::master(size_t b) const {
  return reinterpret_cast<float*>(static_cast<char*>(master_->data()) + buckets_[b].master_offset);
}
void* Optimizer::grad(size_t b) const {
  return static_cast<char*>(grads_->data()) + buckets_[b].grad_offset;
}
const void* Optimizer::param(size_t b) const {
  return static_cast<const char*>(params_->data()) + buckets_[b].param_offset;
}

absl::Status CheckGroupHyper(size_t g, const GroupHyper& h) {
  const auto bad = [g](const char* what, double v, const char* rule) {
    return absl::InvalidArgumentError(absl::StrCat("parameter group ", g, ": ", what, " = ", v,
                                                   " is invalid (", rule,
                                                   "); nothing was changed, fix the value (or "
                                                   "the scheduler that produced it)"));
  };
  if (!std::isfinite(h.lr) || h.lr < 0) return bad("lr", h.lr, "must be finite and >= 0");
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return bad("beta1", h.beta1, "must be in [0, 1)");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return bad("beta2", h.beta2, "must be in [0, 1)");
  if (!std::isfinite(h.eps) || !(h.eps > 0)) return bad("eps", h.eps, "must be finite and > 0");
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0) {
    return bad("weight_decay", h.weight_decay, "must be finite and >= 0");
  }
  return absl::OkStatus();
}

absl::Status Optimizer::SetGroup(size_t g, const GroupHyper& h) {
  if (g >= groups_) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter group ", g, " does not exist (", groups_, " groups)"));
  }
  // Checked here, before the page: a bad value on the page is a protocol violation for which
  // the daemon closes the whole optimizer.
  TSD_RETURN_IF_ERROR(CheckGroupHyper(g, h));
  TSD_RETURN_IF_ERROR(Failure());
  View(control_, groups_).groups[g] = {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
  return absl::OkStatus();
}

double Optimizer::last_grad_norm() const { return View(control_, groups_).header->last_grad_norm; }

uint32_t Optimizer::steps(size_t b) const {
  return View(control_, groups_).buckets[b].steps.load(std::memory_order_acquire);
}

Optimizer::BucketTimes Optimizer::times(size_t b) const {
  const wire::ControlBucket& slot = View(control_, groups_).buckets[b];
  // `done` first (acquire): a client that saw the bucket done sees that delivery's stamps.
  (void)slot.done.load(std::memory_order_acquire);
  return {slot.taken_ns.load(std::memory_order_relaxed),
          slot.began_ns.load(std::memory_order_relaxed),
          slot.ended_ns.load(std::memory_order_relaxed),
          slot.published_ns.load(std::memory_order_relaxed)};
}

absl::Status Optimizer::ReportStep(absl::Duration wait, uint64_t h2d_bytes, uint64_t d2h_bytes) {
  if (wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("ReportStep: the wait (",
                                                   absl::FormatDuration(wait),
                                                   ") is negative; measure it with a "
                                                   "monotonic clock"));
  }
  wire::ControlHeader& h = *View(control_, groups_).header;
  h.client_wait_ns.store(static_cast<uint64_t>(absl::ToInt64Nanoseconds(wait)),
                         std::memory_order_relaxed);
  h.client_h2d_bytes.store(h2d_bytes, std::memory_order_relaxed);
  h.client_d2h_bytes.store(d2h_bytes, std::memory_order_relaxed);
  h.client_reports.fetch_add(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::Status Optimizer::Failure() const {
  if (commit_->is_closed.load(std::memory_order_acquire)) {
    MutexLock lock(commit_->mu_closed);
    return commit_->closed;
  }
  absl::Status why;
  const auto v = View(control_, groups_);
  if (v.header->failed.load(std::memory_order_acquire) != 0) {
    char msg[sizeof(v.header->error) + 1] = {};
    std::memcpy(msg, v.header->error, sizeof(v.header->error));
    why = absl::AbortedError(absl::StrCat("tsd closed this job's optimizer: ", msg));
  } else {
    // Releasing the job zeroes the page, so a session tsd closed shows no failure there: the
    // notice on the side socket (SESSION_CLOSED) says why, and a dead daemon is noticed too.
    // One non-blocking read of the connection: a notice closes it, so an open one means no news.
    std::string dead;
    if (client_->DaemonAlive(&dead)) return absl::OkStatus();
    const std::optional<Notice> n = client_->LastNotice();
    why = n && n->kind == Notice::Kind::kSessionClosed ? absl::AbortedError(n->message)
                                                       : absl::UnavailableError(dead);
  }
  // Every later call fails with the same error.
  MutexLock lock(commit_->mu_closed);
  if (commit_->closed.ok()) {
    commit_->closed = absl::Status(
        why.code(), absl::StrCat(why.message(),
                                 "; this optimizer can take no more steps: wrap or register the "
                                 "model again (with a new session)"));
    commit_->is_closed.store(true, std::memory_order_release);
  }
  return commit_->closed;
}

absl::Status Optimizer::Ready(size_t b, bool first, bool final) {
  if (b >= buckets_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket ", b, " does not exist (", buckets_.size(), " buckets)"));
  }
  TSD_RETURN_IF_ERROR(Failure());
  auto v = View(control_, groups_);
  auto& slot = v.buckets[b];
  const uint64_t done = slot.done.load(std::memory_order_acquire);
  if (slot.ready.load(std::memory_order_relaxed) != done) {
    return absl::FailedPreconditionError(
        absl::StrCat("bucket ", b, " is still being processed; Wait() for it first"));
  }
  slot.flags.store((first ? wire::kDeliveryFirst : 0) | (final ? wire::kDeliveryFinal : 0),
                   std::memory_order_relaxed);
  slot.ready.store(done + 1, std::memory_order_release);
  v.header->doorbell.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&v.header->doorbell);
  return absl::OkStatus();
}

template <typename Done>
absl::Status Optimizer::WaitUntil(Done done, absl::Duration timeout, const char* what) {
  // Closed: the page may be zeroed, where every bucket looks done.
  if (commit_->is_closed.load(std::memory_order_acquire)) return Failure();
  auto v = View(control_, groups_);
  const auto spin_until = std::chrono::steady_clock::now() + kSpin;
  while (std::chrono::steady_clock::now() < spin_until) {
    if (done()) return absl::OkStatus();
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const uint32_t seen = v.header->completions.load(std::memory_order_acquire);
    if (done()) return absl::OkStatus();
    TSD_RETURN_IF_ERROR(Failure());
    std::string why;
    if (!client_->DaemonAlive(&why)) return absl::UnavailableError(why);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("tsd did not finish ", what, " within ", absl::FormatDuration(timeout)));
    }
    wire::FutexWait(&v.header->completions, seen, kSliceNs);
  }
}

absl::Status Optimizer::Wait(size_t b, absl::Duration timeout) {
  if (b >= buckets_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket ", b, " does not exist (", buckets_.size(), " buckets)"));
  }
  auto& slot = View(control_, groups_).buckets[b];
  return WaitUntil(
      [&] {
        return slot.done.load(std::memory_order_acquire) ==
               slot.ready.load(std::memory_order_relaxed);
      },
      timeout, "a bucket update");
}

absl::Status Optimizer::WaitSteps(size_t b, uint32_t steps, absl::Duration timeout) {
  if (b >= buckets_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket ", b, " does not exist (", buckets_.size(), " buckets)"));
  }
  auto& slot = View(control_, groups_).buckets[b];
  return WaitUntil([&] { return slot.steps.load(std::memory_order_acquire) >= steps; }, timeout,
                   "a bucket's step");
}

absl::Status Optimizer::WaitAll(absl::Duration timeout) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TSD_RETURN_IF_ERROR(Wait(b, timeout));
  }
  return absl::OkStatus();
}

absl::Status Optimizer::Commit(absl::Duration timeout, bool wait) {
  TSD_RETURN_IF_ERROR(Failure());
  // Held until this commit is done (or handed over), so a second thread's commit follows it
  // rather than racing it.
  MutexLock lock(commit_->mu);
  auto v = View(control_, groups_);
  // The daemon takes one commit at a time: the previous one must be fully applied first.
  const uint64_t previous = commit_->commits;
  TSD_RETURN_IF_ERROR(
      WaitUntil([&] { return v.header->committed.load(std::memory_order_acquire) >= previous; },
                timeout, "the previous step's commit"));
  const uint64_t target = ++commit_->commits;
  if (world_ > 1) {
    // Data parallel: this rank's counter; the daemon applies the commit once every rank made it.
    wire::ControlView::Of(control_->data(), static_cast<uint32_t>(groups_),
                          static_cast<uint32_t>(buckets_.size()))
        .ranks[rank_]
        .commit.store(target, std::memory_order_release);
  } else {
    v.header->commit.store(target, std::memory_order_release);
  }
  v.header->doorbell.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&v.header->doorbell);
  if (!wait) return absl::OkStatus();
  TSD_RETURN_IF_ERROR(
      WaitUntil([&] { return v.header->committed.load(std::memory_order_acquire) >= target; },
                timeout, "the step's commit"));
  return WaitAll(timeout);
}

absl::Status Optimizer::WaitCommitted(absl::Duration timeout) {
  uint64_t target = 0;
  {
    MutexLock lock(commit_->mu);
    target = commit_->commits;
  }
  auto v = View(control_, groups_);
  return WaitUntil([&] { return v.header->committed.load(std::memory_order_acquire) >= target; },
                   timeout, "the step's commit");
}

absl::Status Optimizer::SetOrder(const std::vector<size_t>& forward) {
  std::vector<uint32_t> order(buckets_.size(), 0);
  for (size_t i = 0; i < forward.size(); ++i) {
    const size_t b = forward[i];
    if (b >= buckets_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("the forward order names bucket ", b,
                                                     " but there are ", buckets_.size(),
                                                     " buckets; nothing was changed"));
    }
    if (order[b] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("the forward order names bucket ", b, " twice; nothing was changed"));
    }
    order[b] = static_cast<uint32_t>(i + 1);
  }
  TSD_RETURN_IF_ERROR(Failure());
  auto v = View(control_, groups_);
  for (size_t b = 0; b < order.size(); ++b)
    v.buckets[b].order.store(order[b], std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Optimizer::SaveState(int fd, absl::Span<const uint32_t> buckets) {
  return client_->StateRequest(true, fd, buckets);
}
absl::StatusOr<uint64_t> Optimizer::LoadState(int fd) { return client_->StateRequest(false, fd); }

absl::StatusOr<Optimizer::Retired> Optimizer::RetireBuckets(absl::Span<const uint32_t> buckets) {
  // The masters are pinned only for this process's own copies (initial values, unwrap,
  // load_state), unless they are the parameter slots, which the GPU reads every step: unpinned,
  // tsd can return the retired buckets' masters as well.
  const bool unpin = master_ != nullptr && params_ != master_ && world_ <= 1;
  if (unpin) master_->Unpin();
  TSD_ASSIGN_OR_RETURN(auto reply, client_->RetireRequest(buckets, unpin));
  return Retired{reply.first, reply.second};
}

}  // namespace tsd
