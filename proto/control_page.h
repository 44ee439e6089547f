// The optimizer's control page: the hot path between a training process and tsd.
//
// A region of the job ("opt/control") that both sides map. The client marks a bucket's gradients
// ready and the daemon marks it updated, with atomic counters and futex wake-ups, so a bucket
// round trip costs microseconds and no gRPC call. The layout is part of the protocol, versioned
// with tsd.proto (kControlPageVersion).
//
// Per bucket b, a delivery is one gradient of the bucket written into its grad slot. The client:
//   1. waits until done[b] == ready[b] (the slot is free again),
//   2. writes the gradient into the slot, sets flags[b] (kFirst: start accumulating afresh;
//      kFinal: apply the optimizer after this delivery), and for a kFinal delivery the group's
//      hyperparameters in groups[] (before the first kFinal delivery of a step),
//   3. stores ready[b] = done[b] + 1 (release), increments `doorbell` and FUTEX_WAKEs it.
// The daemon accumulates or steps, then stores done[b] = ready[b] (release), increments
// `completions` and FUTEX_WAKEs it. With clipping (max_grad_norm > 0), kFinal deliveries are
// held until the client increments `commit` (its step() call); then the daemon computes the global
// norm over the held buckets and updates them all.
//
// Optionally, the client writes each bucket's `order`: 1 + its rank in the order the model's
// forward first uses the buckets (0: none given). The daemon then runs queued updates, and the
// updates of a commit, lowest order first (buckets without one last, by index), so the next
// forward can start on the first buckets while the others are still being updated. It is only a
// sort key: any value is safe, none changes a result.
//
// Data parallel (docs/distributed.md): when the optimizer was registered for a world of N > 1 ranks
// (RegisterOptimizerRequest.world), N sessions of the job share this page. Each bucket is written
// by one rank (its owner, a client-side choice: a ready counter stored twice with the same value
// still steps the bucket once), and the single `commit` counter is replaced by one per rank in
// `ranks[]`, after the buckets: a commit is applied once every rank's counter reached it. The
// header's `commit` is then unused.
//
// The daemon trusts nothing here: a counter that is not exactly done+1 or done, unknown flag
// bits, out-of-range hyperparameters or a bad commit counter close the session with a logged
// reason (written to `error` as well).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace tsd::wire {

inline constexpr uint32_t kControlPageMagic = 0x54534450;  // "TSDP"
inline constexpr uint32_t kControlPageVersion = 1;

// Bits of ControlBucket::flags.
inline constexpr uint32_t kDeliveryFirst = 1u << 0;
inline constexpr uint32_t kDeliveryFinal = 1u << 1;
inline constexpr uint32_t kDeliveryKnownFlags = kDeliveryFirst | kDeliveryFinal;

// Per-group hyperparameters, written by the client, read by the daemon at update time.
struct alignas(64) ControlGroup {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
};

// Per-bucket counters. One cache line each, so the two sides do not false-share neighbours.
struct alignas(64) ControlBucket {
  std::atomic<uint64_t> ready;  // written by the client
  std::atomic<uint64_t> done;   // written by the daemon
  std::atomic<uint32_t> flags;  // written by the client before `ready`
  std::atomic<uint32_t> steps;  // written by the daemon: optimizer steps applied to this bucket
  std::atomic<uint32_t> order;  // written by the client: 1 + the bucket's forward rank, 0 = none
  // Written by the daemon, for measurement only (CLOCK_MONOTONIC nanoseconds, the clock of every
  // process on the host; 0 until the first): when it took the bucket's last delivery, when the
  // work on it last began and ended (its first chunk's start, its last chunk's end: an
  // accumulation, a hold's sums of squares, an update, a speculation or a redo), and when it
  // last stored `done`. They filled the line's free bytes, so the layout did not change.
  std::atomic<uint64_t> taken_ns;
  std::atomic<uint64_t> began_ns;
  std::atomic<uint64_t> ended_ns;
  std::atomic<uint64_t> published_ns;
};
static_assert(sizeof(ControlBucket) == 64, "a bucket's counters fill one cache line");

struct alignas(64) ControlHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t num_groups;
  uint32_t num_buckets;
  uint32_t world;  // daemon: ranks sharing the page (0: one, the header's `commit`)
  alignas(64) std::atomic<uint32_t> doorbell;     // client increments and wakes (futex word)
  alignas(64) std::atomic<uint32_t> completions;  // daemon increments and wakes (futex word)
  alignas(64) std::atomic<uint64_t> commit;       // client: step() calls (for clipping)
  std::atomic<uint64_t> committed;                // daemon: commits fully applied
  std::atomic<uint32_t> failed;                   // daemon: nonzero once the session is closed
  char error[252];                                // daemon: why (NUL-terminated)
  alignas(64) double last_grad_norm;              // daemon: the global norm of the last commit
  // The client's report of its last step, for display only (`tsctl top`): what the daemon cannot
  // see. Zero until a client reports (older clients never do). `client_reports` is stored last.
  std::atomic<uint64_t> client_wait_ns;    // client: how long its last step() waited for tsd
  std::atomic<uint64_t> client_h2d_bytes;  // client: its last step's paging, host to device
  std::atomic<uint64_t> client_d2h_bytes;  // client: and device to host
  std::atomic<uint64_t> client_reports;    // client: reports written (the step it reported)
};

// Per-rank counters of a data-parallel optimizer (world > 1), one cache line each.
struct alignas(64) ControlRank {
  std::atomic<uint64_t> commit;  // rank r's client: its step() calls (for clipping)
};
static_assert(sizeof(ControlRank) == 64, "a rank's counters fill one cache line");

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "control page counters must be lock-free to live in shared memory");

// The client's report shares last_grad_norm's cache line: the header's size (and so the layout of
// the page) is what it was before the report was added.
static_assert(sizeof(ControlHeader) == 576,
              "the control page header's size is part of the protocol");

// Byte offsets of the page's parts for `groups` groups, `buckets` buckets and `world` ranks (the
// per-rank part exists only for world > 1).
inline constexpr size_t ControlGroupsOffset() { return sizeof(ControlHeader); }
inline constexpr size_t ControlBucketsOffset(uint32_t groups) {
  return sizeof(ControlHeader) + static_cast<size_t>(groups) * sizeof(ControlGroup);
}
inline constexpr size_t ControlRanksOffset(uint32_t groups, uint32_t buckets) {
  return ControlBucketsOffset(groups) + static_cast<size_t>(buckets) * sizeof(ControlBucket);
}
inline constexpr size_t ControlPageBytes(uint32_t groups, uint32_t buckets, uint32_t world = 0) {
  return ControlRanksOffset(groups, buckets) +
         (world > 1 ? static_cast<size_t>(world) * sizeof(ControlRank) : 0);
}

// Typed view of a mapped control page (no ownership).
struct ControlView {
  ControlHeader* header = nullptr;
  ControlGroup* groups = nullptr;
  ControlBucket* buckets = nullptr;
  ControlRank* ranks = nullptr;  // world > 1 only, and only from the three-argument Of

  static ControlView Of(void* base, uint32_t groups) {
    auto* p = static_cast<char*>(base);
    return {reinterpret_cast<ControlHeader*>(p),
            reinterpret_cast<ControlGroup*>(p + ControlGroupsOffset()),
            reinterpret_cast<ControlBucket*>(p + ControlBucketsOffset(groups))};
  }
  // With the per-rank part (the page must hold ControlPageBytes(groups, buckets, world)).
  static ControlView Of(void* base, uint32_t groups, uint32_t buckets) {
    ControlView v = Of(base, groups);
    v.ranks = reinterpret_cast<ControlRank*>(static_cast<char*>(base) +
                                             ControlRanksOffset(groups, buckets));
    return v;
  }
};

}  // namespace tsd::wire
