// Fuzzes the optimizer's control-page scanner: the daemon reads counters, flags, a commit counter
// and hyperparameters from a page that the client can write at any time, so every value it reads
// there is untrusted. Each input sets up a job with a small optimizer in-process (two groups,
// three buckets, accumulation and clipping on), maps its control page as a client would, and
// plays rounds: each round writes what the input says into the fields a client writes (the
// groups' hyperparameters, a bucket's ready counter and flags, the commit counter), sometimes
// scribbles over the daemon's own fields too, rings the doorbell and waits until the dispatcher has
// done what the round set off (a completion, a hold, a commit: a model of the dispatcher's state
// says which) or has failed the optimizer, with 20 ms as a fallback where a scribble leaves the
// model unsure. Nothing may crash or touch memory out of bounds, a failure must say why, and the
// job's books must balance once it is released.
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "daemon/jobs/registry.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/side_handler.h"
#include "proto/control_page.h"
#include "proto/futex.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace {

constexpr uint32_t kGroups = 2, kBuckets = 3;

tsd::WorkerPool& Pool() {
  static auto* pool = new tsd::WorkerPool(1, false);
  return *pool;
}

// Reads `n` bytes of input into `out` (zero-filled past the end); advances `at`.
void Take(const uint8_t* data, size_t size, size_t& at, void* out, size_t n) {
  std::memset(out, 0, n);
  const size_t k = at < size ? std::min(n, size - at) : 0;
  if (k > 0) std::memcpy(out, data + at, k);
  at += n;
}

// What the fuzzer expects the dispatcher to do with one round, from the page's counters before
// and after the round's writes.
struct Expect {
  bool fail = false;         // an invalid counter, flag or commit: the optimizer fails
  uint32_t holds = 0;        // final deliveries held for the commit (each rings the doorbell)
  bool hold[kBuckets] = {};  // which
  bool commit = false;       // the commit is applied (clipping, commit == committed + 1)
  uint64_t commit_to = 0;
};

// The dispatcher's state as the fuzzer tracks it, so that a round waits for exactly what it set
// off (a delivery completed, a hold, a commit, a failure) instead of a fixed time: the wait was
// what made this target slow.
struct Model {
  bool held[kBuckets] = {};
  uint64_t committed = 0;

  Expect Predict(const tsd::wire::ControlView& v, const uint64_t before[kBuckets], bool clip) {
    Expect e;
    for (uint32_t b = 0; b < kBuckets; ++b) {
      const uint64_t ready = v.buckets[b].ready.load(), done = v.buckets[b].done.load();
      if (ready == before[b]) continue;
      const uint64_t taken = done + (held[b] ? 1 : 0);
      if (ready == taken) continue;
      const uint32_t flags = v.buckets[b].flags.load();
      if (ready != taken + 1 || held[b] || (flags & ~tsd::wire::kDeliveryKnownFlags) != 0) {
        e.fail = true;
      } else if (clip && (flags & tsd::wire::kDeliveryFinal)) {
        e.hold[b] = true;
        ++e.holds;
      }
    }
    const uint64_t commit = v.header->commit.load();
    if (commit < committed || commit > committed + 1) {
      e.fail = true;
    } else if (clip && commit == committed + 1) {
      e.commit = true;
      e.commit_to = commit;
    }
    return e;
  }

  // True once the dispatcher has done what `e` expects (failures are checked by the caller).
  bool Settled(const tsd::wire::ControlView& v, const Expect& e, uint32_t rung) const {
    if (e.fail) return false;
    if (static_cast<uint32_t>(v.header->doorbell.load() - rung) < e.holds) return false;
    if (e.commit && v.header->committed.load() < e.commit_to) return false;
    for (uint32_t b = 0; b < kBuckets; ++b) {
      const bool stays_held = (held[b] || e.hold[b]) && !e.commit;
      if (!stays_held && v.buckets[b].done.load() != v.buckets[b].ready.load()) return false;
    }
    return true;
  }

  void Advance(const tsd::wire::ControlView&, const Expect& e) {
    for (uint32_t b = 0; b < kBuckets; ++b) held[b] = (held[b] || e.hold[b]) && !e.commit;
    if (e.commit) committed = e.commit_to;
  }
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tsd::RegistryOptions options;
  options.pool_bytes = options.max_job_quota_bytes = 16 << 20;
  options.pool = &Pool();
  tsd::Registry registry(options);
  tsd::SideHandler handler(registry);
  tsd::SideCaller caller{.uid = 1000, .pid = 4242, .session_id = 0};
  tsd::v1::SideRequest req;
  req.set_request_id(1);
  req.mutable_attach()->set_job("fuzz");
  req.mutable_attach()->set_protocol_version(tsd::wire::kProtocolVersion);
  caller.session_id = handler.Handle(caller, req, -1).bound_session;
  req.Clear();
  req.set_request_id(2);
  auto* reg = req.mutable_register_optimizer();
  for (uint32_t g = 0; g < kGroups; ++g) {
    auto* grp = reg->add_groups();
    grp->set_lr(1e-3);
    grp->set_beta1(0.9);
    grp->set_beta2(0.999);
    grp->set_eps(1e-8);
  }
  for (uint64_t n : {3, 5, 7}) {
    auto* b = reg->add_buckets();
    b->set_group(n == 5 ? 1 : 0);
    b->set_numel(n);
    b->set_grad_dtype(n == 7 ? tsd::v1::BF16 : tsd::v1::F32);
    b->set_param_dtype(tsd::v1::F32);
  }
  reg->set_accumulate(true);
  reg->set_max_grad_norm(data[0 % (size ? size : 1)] & 1 ? 1.0 : 0.0);
  if (size == 0 || handler.Handle(caller, req, -1).reply.code() != 0) return 0;
  auto regions = registry.ListRegions(caller.session_id);
  if (!regions.ok()) std::abort();
  uint64_t control_id = 0;
  for (const auto& r : *regions) {
    if (r.name() == "opt/control") control_id = r.region_id();
  }
  auto fd = registry.GetFd(caller.session_id, control_id);
  if (!fd.ok()) std::abort();
  const size_t bytes = tsd::wire::ControlPageBytes(kGroups, kBuckets);
  void* page = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
  close(fd->fd);
  if (page == MAP_FAILED) std::abort();
  const tsd::wire::ControlView v = tsd::wire::ControlView::Of(page, kGroups);

  const bool clip = reg->max_grad_norm() > 0;
  Model model;
  size_t at = 1;
  while (at < size && v.header->failed.load() == 0) {
    uint64_t before[kBuckets];
    for (uint32_t b = 0; b < kBuckets; ++b) before[b] = v.buckets[b].ready.load();
    uint8_t op = 0;
    Take(data, size, at, &op, 1);
    switch (op % 5) {
      case 0: {  // a group's hyperparameters
        uint8_t g = 0;
        Take(data, size, at, &g, 1);
        Take(data, size, at, &v.groups[g % kGroups], sizeof(tsd::wire::ControlGroup));
        break;
      }
      case 1:    // a delivery: the next ready count, with flags
      case 2: {  // any ready count and flags
        uint8_t b = 0;
        uint32_t flags = 0;
        uint64_t ready = 0;
        Take(data, size, at, &b, 1);
        Take(data, size, at, &flags, 4);
        auto& slot = v.buckets[b % kBuckets];
        if (op % 5 == 1) {
          ready = slot.done.load() + 1;
          flags &= tsd::wire::kDeliveryKnownFlags;
        } else {
          Take(data, size, at, &ready, 8);
        }
        slot.flags.store(flags);
        slot.ready.store(ready);
        break;
      }
      case 3: {  // a commit: the next one, or any
        uint64_t commit = 0;
        Take(data, size, at, &commit, 8);
        v.header->commit.store(commit & 1 ? v.header->committed.load() + 1 : commit);
        break;
      }
      case 4: {  // scribble over the header, the daemon's counters included
        uint16_t offset = 0;
        uint64_t value = 0;
        Take(data, size, at, &offset, 2);
        Take(data, size, at, &value, 8);
        // Anywhere before `failed` (which says whether the daemon failed the optimizer).
        const size_t o = offset % (offsetof(tsd::wire::ControlHeader, failed) - 7);
        std::memcpy(static_cast<char*>(page) + o, &value, 8);
        break;
      }
    }
    const Expect expect = model.Predict(v, before, clip);
    const uint32_t rung = v.header->doorbell.fetch_add(1) + 1;
    tsd::wire::FutexWakeAll(&v.header->doorbell);
    // Wait for what the dispatcher will do with this round; if the model cannot tell (the round
    // scribbled over counters it relies on), give up after 20 ms as before.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    for (;;) {
      const uint32_t seen = v.header->completions.load();
      if (v.header->failed.load() != 0 || model.Settled(v, expect, rung)) break;
      if (std::chrono::steady_clock::now() >= deadline) break;
      // Completions and failures wake the completions word; holds ring the doorbell.
      tsd::wire::FutexWait(&v.header->completions, seen, 100'000);
    }
    if (v.header->failed.load() == 0) model.Advance(v, expect);
  }
  if (v.header->failed.load() != 0 && v.header->error[0] == '\0') std::abort();  // says why
  munmap(page, bytes);
  registry.SessionDisconnected(caller.session_id);
  if (registry.Snapshot().used_bytes != 0) std::abort();
  return 0;
}
