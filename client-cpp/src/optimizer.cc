#include "tsd/optimizer.h"

#include <chrono>
#include <cstring>
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
};

Optimizer::Optimizer() : commit_(std::make_unique<CommitState>()) {}
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

void Optimizer::SetGroup(size_t g, const GroupHyper& h) {
  View(control_, groups_).groups[g] = {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay};
}

double Optimizer::last_grad_norm() const { return View(control_, groups_).header->last_grad_norm; }

uint32_t Optimizer::steps(size_t b) const {
  return View(control_, groups_).buckets[b].steps.load(std::memory_order_acquire);
}

absl::Status Optimizer::Failure() const {
  const auto v = View(control_, groups_);
  if (v.header->failed.load(std::memory_order_acquire) == 0) return absl::OkStatus();
  char msg[sizeof(v.header->error) + 1] = {};
  std::memcpy(msg, v.header->error, sizeof(v.header->error));
  return absl::AbortedError(absl::StrCat("tsd closed this job's optimizer: ", msg));
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

absl::Status Optimizer::WaitAll(absl::Duration timeout) {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TSD_RETURN_IF_ERROR(Wait(b, timeout));
  }
  return absl::OkStatus();
}

absl::Status Optimizer::Commit(absl::Duration timeout) {
  TSD_RETURN_IF_ERROR(Failure());
  // Held until this commit is done, so a second thread's commit follows it rather than racing it.
  MutexLock lock(commit_->mu);
  auto v = View(control_, groups_);
  const uint64_t target = ++commit_->commits;
  v.header->commit.store(target, std::memory_order_release);
  v.header->doorbell.fetch_add(1, std::memory_order_release);
  wire::FutexWakeAll(&v.header->doorbell);
  TSD_RETURN_IF_ERROR(
      WaitUntil([&] { return v.header->committed.load(std::memory_order_acquire) >= target; },
                timeout, "the step's commit"));
  return WaitAll(timeout);
}

absl::StatusOr<uint64_t> Optimizer::SaveState(int fd) { return client_->StateRequest(true, fd); }
absl::StatusOr<uint64_t> Optimizer::LoadState(int fd) { return client_->StateRequest(false, fd); }

}  // namespace tsd
