// JobOptimizer's side of the trainer's GPU share: retiring buckets whose optimizer moved out of
// tsd. wrap(optimizer_gpu_fraction="auto") decides the share after a measured step, reads the
// moved buckets' state (SaveState with a bucket list) and from then on updates them with torch's
// AdamW in VRAM; without this their moments (8 bytes a parameter in fp32, 4 in bf16) and
// accumulator would stay locked in the host pool for the rest of the job. Retiring punches those
// pages out of the regions and lowers the job's charge (the Registry uncharges what this returns).
//
// Released: both moments and the accumulator (only the daemon maps them), and the masters where
// the trainer says it unpinned them (masters_unpinned) and they are not the parameter slots. The
// trainer registers every region it maps with CUDA, and pinned pages stay alive until it
// unregisters them, so punching them would lower the charge without returning the memory: the
// gradient and parameter slots (its DMA buffers) always stay.
#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/optimizer/job_optimizer.h"
#include "proto/status_macros.h"
#include "spdlog/spdlog.h"

namespace tsd {

absl::StatusOr<std::vector<JobOptimizer::Released>> JobOptimizer::RetireBuckets(
    absl::Span<const uint32_t> buckets, bool masters_unpinned) {
  TSD_RETURN_IF_ERROR(CheckBucketList("retire_buckets", buckets));
  if (plan_.world > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "retire_buckets: the optimizer is shared by ", plan_.world,
        " data-parallel ranks; their GPU share is fixed at wrap(), before registering, so no "
        "bucket moves out of tsd later"));
  }
  if (failed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("retire_buckets: the optimizer has failed: ", failure()));
  }
  MutexLock lock(state_mu_);
  for (const uint32_t b : buckets) {
    const BucketRun& run = *runs_[b];
    if (run.retired) continue;
    if (run.busy.load(std::memory_order_acquire) || run.held ||
        page_.buckets[b].ready.load(std::memory_order_acquire) != run.done_local) {
      return absl::FailedPreconditionError(absl::StrCat(
          "retire_buckets: bucket ", b,
          " has a delivery in flight or held for the step's commit; retire buckets between "
          "steps, once every update of the step is done"));
    }
  }
  size_t newly = 0;
  for (const uint32_t b : buckets) {
    if (!runs_[b]->retired) {
      runs_[b]->retired = true;
      ++newly;
    }
  }
  retired_count_.fetch_add(newly, std::memory_order_acq_rel);

  // Per region, the union of every retired bucket's bytes (those retired before included, so a
  // page two retired neighbours share is released once both are gone).
  const uint64_t msize = kernels::DTypeSize(plan_.moment_dtype);
  struct Part {
    Region* region;
    uint64_t BucketPlan::*offset;
    uint64_t bytes_per_element;
  };
  std::vector<Part> parts;
  if (masters_unpinned && !plan_.params_in_master) {
    parts.push_back({regions_.master.get(), &BucketPlan::master_offset, 4});
  }
  parts.push_back({regions_.exp_avg.get(), &BucketPlan::moment_offset, msize});
  parts.push_back({regions_.exp_avg_sq.get(), &BucketPlan::moment_offset, msize});
  if (regions_.accum) parts.push_back({regions_.accum.get(), &BucketPlan::master_offset, 4});

  std::vector<Released> out;
  for (const Part& part : parts) {
    if (part.region == nullptr) continue;
    std::map<uint64_t, uint64_t> spans;  // begin -> end, merged below
    for (const auto& run : runs_) {
      if (!run->retired) continue;
      const uint64_t begin = run->plan.*part.offset;
      spans[begin] = begin + static_cast<uint64_t>(run->plan.numel) * part.bytes_per_element;
    }
    uint64_t fresh = 0;
    for (auto it = spans.begin(); it != spans.end();) {
      uint64_t begin = it->first, end = it->second;
      for (++it; it != spans.end() && it->first <= end; ++it) end = std::max(end, it->second);
      absl::StatusOr<uint64_t> released = part.region->Release(begin, end - begin);
      if (!released.ok()) {
        // The buckets stay retired (their state may be partly gone); the job keeps running.
        return absl::InternalError(absl::StrCat("retire_buckets: ", released.status().message()));
      }
      fresh += *released;
    }
    if (fresh > 0) out.push_back({part.region->name(), fresh});
  }
  uint64_t total = 0;
  for (const Released& r : out) total += r.bytes;
  spdlog::info("event=buckets_retired job={} buckets={} newly={} retired={} released_bytes={}",
               job_, buckets.size(), newly, retired_count_.load(), total);
  return out;
}

}  // namespace tsd
