// JobOptimizer::DescribeActivity: the optimizer's figures for `tsctl top` and `tsctl jobs --json`,
// from its StepStats and from the client's report on the control page.

#include "daemon/optimizer/job_optimizer.h"

namespace tsd {
namespace {

v1::DType ToProto(kernels::DType d) {
  switch (d) {
    case kernels::DType::kF32:
      return v1::F32;
    case kernels::DType::kBF16:
      return v1::BF16;
    case kernels::DType::kF16:
      return v1::F16;
  }
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace

void JobOptimizer::DescribeActivity(v1::JobActivity& out) const {
  const StepStats::Snapshot s =
      stats_.Read(StepStats::Clock::now(), work_busy_ns_.load(std::memory_order_relaxed));
  out.set_steps(s.steps);
  uint64_t params = 0;
  for (const BucketPlan& b : plan_.buckets) params += static_cast<uint64_t>(b.numel);
  out.set_params(params);
  out.set_params_updated(s.params_updated);
  out.set_bucket_updates(s.bucket_updates);
  out.set_steps_per_s(s.steps_per_s);
  out.set_params_per_s(s.params_per_s);
  out.set_bucket_update_p50_s(s.bucket_update_p50_s);
  out.set_bucket_update_p99_s(s.bucket_update_p99_s);
  out.set_moment_dtype(ToProto(plan_.moment_dtype));
  out.set_speculated_commits(speculated_commits_.load(std::memory_order_relaxed));
  out.set_redone_commits(redone_commits_.load(std::memory_order_relaxed));
  out.set_work_busy_s(static_cast<double>(work_busy_ns_.load(std::memory_order_relaxed)) * 1e-9);
  if (pool_.threads() > 0) out.set_work_busy_share(s.busy_s_per_s / pool_.threads());
  // The client wrote these (it may write anything): they are copied as numbers, never used.
  const wire::ControlHeader& h = *page_.header;
  const uint64_t reports = h.client_reports.load(std::memory_order_acquire);
  out.set_client_reports(reports);
  if (reports > 0) {
    out.set_client_step_wait_s(
        static_cast<double>(h.client_wait_ns.load(std::memory_order_relaxed)) * 1e-9);
    out.set_client_h2d_bytes(h.client_h2d_bytes.load(std::memory_order_relaxed));
    out.set_client_d2h_bytes(h.client_d2h_bytes.load(std::memory_order_relaxed));
  }
}

}  // namespace tsd
