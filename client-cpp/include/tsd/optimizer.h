// tsd::Optimizer: the client side of the daemon's AdamW engine.
//
// `Client::RegisterOptimizer` lays out a job's parameters as buckets in the daemon and maps the
// parts a training process touches: fp32 master weights (initialise them before the first step),
// a gradient slot and a parameter slot per bucket, and the control page. The hot path never makes
// a gRPC call: `Ready(b)` publishes a bucket's gradients and rings the doorbell, the daemon's CPU
// threads update the bucket while the caller goes on (e.g. with backward), and `Wait(b)` returns
// once the updated parameters are in the bucket's param slot.
//
//   auto opt = client->RegisterOptimizer(spec);
//   std::memcpy((*opt)->master(0), weights, n * 4);                 // once
//   (*opt)->SetGroup(0, {.lr = 1e-3});                              // each step (schedulers)
//   std::memcpy((*opt)->grad(0), grads, n * 4); (*opt)->Ready(0);   // as each gradient lands
//   (*opt)->Wait(0);                                                // before the bucket is used
//
// Methods for different buckets may be called from different threads; one bucket is driven by
// one thread at a time. Commit may be called from any thread: concurrent commits are serialised
// (the daemon requires the commit counter to advance one step at a time).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace tsd {

class Client;
class Region;
struct GroupHyper;

// The checks SetGroup makes (also usable before registering).
absl::Status CheckGroupHyper(size_t g, const GroupHyper& h);

enum class DType : uint8_t { kF32 = 1, kBF16 = 2, kF16 = 3 };
size_t DTypeBytes(DType d);

// One parameter group's hyperparameters, as torch.optim.AdamW names them.
struct GroupHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

struct BucketSpec {
  uint32_t group = 0;
  uint64_t numel = 0;
  DType grad_dtype = DType::kF32;
  DType param_dtype = DType::kF32;
};

struct OptimizerSpec {
  std::vector<GroupHyper> groups;
  std::vector<BucketSpec> buckets;
  DType moment_dtype = DType::kF32;  // kF32 or kBF16 (stochastic rounding)
  double max_grad_norm = 0;          // > 0: clip by global norm; call Commit() each step
  bool accumulate = false;           // allow deliveries that accumulate (first/final flags)
  uint64_t seed = 0;
  // Refused with a clear error (tsd's AdamW does not implement them).
  bool amsgrad = false;
  bool maximize = false;
  // Data parallel (docs/distributed.md): world > 1 shares the job's optimizer between `world`
  // sessions of the job, this one being rank `rank`. The first registers it, the others join it
  // with the same spec. Each bucket must be delivered by one rank only (its owner); Commit()
  // counts this rank's steps, and the daemon applies a commit once every rank made it.
  uint32_t rank = 0;
  uint32_t world = 0;
  // The PCI address of the GPU this trainer uses ("0000:c1:00.0"), or empty: on a host of several
  // NUMA nodes tsd places the job's optimizer threads and memory on that GPU's node.
  std::string pci_bus_id;
  // With max_grad_norm: true holds every update until Commit(). False (default) lets tsd apply
  // updates as deliveries arrive while the last norm was under 0.8x the limit, undoing and
  // redoing them at Commit() when clipping bites (RegisterOptimizerRequest.hold_clipped_updates).
  bool hold_clipped_updates = false;
};

// Where a resumed optimizer stands (Client::ResumeOptimizer): tsd finished every delivery the
// dead trainer had rung (and a commit it had asked), and dropped what waited for the trainer.
struct ResumeReport {
  std::vector<uint64_t> bucket_steps;     // optimizer steps applied to each bucket
  uint64_t committed = 0;                 // commits applied (with clipping: steps completed)
  std::vector<uint32_t> rolled_back;      // buckets whose held final delivery was dropped
  std::vector<uint32_t> dropped_partial;  // buckets whose partial accumulation was dropped
};

class Optimizer final {
 public:
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  size_t num_buckets() const { return buckets_.size(); }
  size_t num_groups() const { return groups_; }
  uint64_t numel(size_t b) const { return buckets_[b].numel; }
  // The bucket's fp32 master weights (shared with the daemon; write them before the first step).
  float* master(size_t b) const;
  // The bucket's gradient slot, in its grad dtype. Write only while the bucket is idle.
  void* grad(size_t b) const;
  // The bucket's updated parameters, in its param dtype. Valid after Wait(b). When every bucket's
  // parameters are fp32 this is the master itself (the daemon keeps no second copy).
  const void* param(size_t b) const;

  // Writes group `g`'s hyperparameters for the next step's updates. Refuses (INVALID_ARGUMENT,
  // naming the value, writing nothing) a non-finite or negative lr, a beta outside [0, 1), an eps
  // that is not finite and positive, or a non-finite or negative weight_decay.
  absl::Status SetGroup(size_t g, const GroupHyper& h);
  // Publishes bucket b's gradient slot and rings the doorbell. `first`: start accumulating afresh;
  // `final`: update the parameters after this delivery. The defaults are one delivery per step.
  // Call only when the bucket is idle (after Wait(b)).
  absl::Status Ready(size_t b, bool first = true, bool final = true);
  // Waits until bucket b's last delivery is processed.
  absl::Status Wait(size_t b, absl::Duration timeout = absl::Seconds(600));
  // Waits for every bucket.
  absl::Status WaitAll(absl::Duration timeout = absl::Seconds(600));
  // With clipping: ends the step; the daemon clips by the global norm of the held final
  // deliveries and updates them. With `wait`, returns once all are updated; without, once the
  // commit is handed over (after the previous commit was fully applied): Wait(b) then waits for
  // bucket b's clipped update and WaitCommitted() for all of them (and the norm).
  absl::Status Commit(absl::Duration timeout = absl::Seconds(600), bool wait = true);
  // Waits until every Commit so far is fully applied (last_grad_norm() is then this one's).
  absl::Status WaitCommitted(absl::Duration timeout = absl::Seconds(600));
  // Tells the daemon the order in which the next forward uses the buckets (`forward[i]` is the
  // i-th bucket it needs): queued updates, and those of a commit, then run in that order. Buckets
  // not listed go after the listed ones. Refuses (INVALID_ARGUMENT, writing nothing) an index out
  // of range or a bucket listed twice. Results do not depend on it.
  absl::Status SetOrder(const std::vector<size_t>& forward);
  // The global gradient norm of the last Commit.
  double last_grad_norm() const;
  // Optimizer steps applied to bucket b.
  uint32_t steps(size_t b) const;
  // When tsd last took bucket b's delivery, began and ended work on it, and published it
  // (CLOCK_MONOTONIC ns, 0 until then; the control page's stamps, for measurement only).
  struct BucketTimes {
    uint64_t taken_ns = 0, began_ns = 0, ended_ns = 0, published_ns = 0;
  };
  BucketTimes times(size_t b) const;
  // Waits until at least `steps` optimizer steps were applied to bucket b: how a data-parallel
  // rank that does not deliver the bucket knows its parameter slot holds the step's update.
  absl::Status WaitSteps(size_t b, uint32_t steps, absl::Duration timeout = absl::Seconds(600));
  // The data-parallel rank and world this optimizer was registered with (0, 0: one process).
  uint32_t rank() const { return rank_; }
  uint32_t world() const { return world_; }
  // Tells tsd about the step just finished, for `tsctl top` only (tsd shows it, never acts on
  // it): how long step() waited for tsd, and the bytes paged host to device and device to host.
  // A negative wait is refused (INVALID_ARGUMENT).
  absl::Status ReportStep(absl::Duration wait, uint64_t h2d_bytes, uint64_t d2h_bytes);

  // Writes the state (master, moments, steps) as safetensors into `fd` (a regular file or a
  // memfd); reads it back. Both need every bucket idle. `buckets`: only these (strictly
  // ascending; empty: all), a partial file LoadState refuses.
  absl::StatusOr<uint64_t> SaveState(int fd, absl::Span<const uint32_t> buckets = {});
  absl::StatusOr<uint64_t> LoadState(int fd);
  // Tells tsd that these buckets' optimizer moved into this process (the GPU share): tsd refuses
  // their deliveries from now on, leaves them out of SaveState, and returns their moments' and
  // accumulator's memory to the pool, and their masters' too where the masters are not the
  // parameter slots (this process then unpins the master region: its copies to and from it
  // become pageable ones). Strictly ascending indices, each idle (between steps); already retired
  // ones are skipped. Refused under data parallel.
  struct Retired {
    uint64_t released_bytes = 0;  // returned to the pool by this call
    uint32_t retired = 0;         // buckets retired so far
  };
  absl::StatusOr<Retired> RetireBuckets(absl::Span<const uint32_t> buckets);

  const std::string& isa() const { return isa_; }
  uint32_t threads() const { return threads_; }
  uint64_t state_bytes() const { return state_bytes_; }

 private:
  friend class Client;
  struct Bucket {
    uint64_t numel = 0;
    DType grad_dtype = DType::kF32, param_dtype = DType::kF32;
    uint64_t master_offset = 0, grad_offset = 0, param_offset = 0;
  };
  // The commit counter and the lock that serialises commits (defined in optimizer.cc, so this
  // installed header needs no mutex type of tsd's).
  struct CommitState;
  Optimizer();
  // A resumed optimizer continues the commit count the dead trainer reached.
  void ContinueCommits(uint64_t committed);
  // Waits until `done()` or the daemon reports a failure or disappears.
  template <typename Done>
  absl::Status WaitUntil(Done done, absl::Duration timeout, const char* what);
  absl::Status Failure() const;

  Client* client_ = nullptr;
  std::shared_ptr<Region> control_, master_, grads_, params_;
  std::vector<Bucket> buckets_;
  size_t groups_ = 0;
  uint32_t rank_ = 0, world_ = 0;
  const std::unique_ptr<CommitState> commit_;
  std::string isa_;
  uint32_t threads_ = 0;
  uint64_t state_bytes_ = 0;
};

}  // namespace tsd
