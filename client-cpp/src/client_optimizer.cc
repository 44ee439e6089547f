// Client's optimizer calls: registering (and resuming) a job's optimizer, the dry run of its
// layout, and streaming its state to and from a descriptor (save, load, checkpoint).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "client_impl.h"
#include "proto/control_page.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd {

using client_detail::kMinStateTimeout;

// The registration request for `spec`: what RegisterOptimizer sends and PlanOptimizer dry-runs.
static v1::RegisterOptimizerRequest RegistrationRequest(const OptimizerSpec& spec) {
  v1::RegisterOptimizerRequest req;
  for (const auto& g : spec.groups) {
    auto* p = req.add_groups();
    p->set_lr(g.lr);
    p->set_beta1(g.beta1);
    p->set_beta2(g.beta2);
    p->set_eps(g.eps);
    p->set_weight_decay(g.weight_decay);
    p->set_amsgrad(spec.amsgrad);
    p->set_maximize(spec.maximize);
  }
  for (const auto& b : spec.buckets) {
    auto* p = req.add_buckets();
    p->set_group(b.group);
    p->set_numel(b.numel);
    p->set_grad_dtype(static_cast<v1::DType>(b.grad_dtype));
    p->set_param_dtype(static_cast<v1::DType>(b.param_dtype));
  }
  req.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  req.set_max_grad_norm(spec.max_grad_norm);
  req.set_accumulate(spec.accumulate);
  req.set_seed(spec.seed);
  req.set_rank(spec.rank);
  req.set_world(spec.world);
  req.set_pci_bus_id(spec.pci_bus_id);
  req.set_hold_clipped_updates(spec.hold_clipped_updates);
  req.set_params_in_master_ok(true);  // Register maps a parameter slot in opt/master when told to
  return req;
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::RegisterOptimizer(const OptimizerSpec& spec) {
  return Register(spec, /*resume=*/false, nullptr);
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::Register(const OptimizerSpec& spec, bool resume,
                                                            ResumeReport* report) {
  v1::RegisterOptimizerRequest req = RegistrationRequest(spec);
  req.set_resume(resume);
  v1::RegisterOptimizerResponse resp;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest side;
    *side.mutable_register_optimizer() = std::move(req);
    TSD_ASSIGN_OR_RETURN(v1::SideReply reply,
                         impl_->CallNoFd(std::move(side), "register_optimizer"));
    resp = std::move(*reply.mutable_register_optimizer());
  }
  std::unique_ptr<Optimizer> opt(new Optimizer);
  opt->client_ = this;
  opt->groups_ = spec.groups.size();
  opt->rank_ = spec.rank;
  opt->world_ = spec.world > 1 ? spec.world : 0;
  opt->isa_ = resp.isa();
  opt->threads_ = resp.threads();
  opt->state_bytes_ = resp.state_bytes();
  for (int b = 0; b < resp.buckets_size(); ++b) {
    Optimizer::Bucket bk;
    bk.numel = spec.buckets[static_cast<size_t>(b)].numel;
    bk.grad_dtype = spec.buckets[static_cast<size_t>(b)].grad_dtype;
    bk.param_dtype = spec.buckets[static_cast<size_t>(b)].param_dtype;
    bk.master_offset = resp.buckets(b).master_offset();
    bk.grad_offset = resp.buckets(b).grad_offset();
    bk.param_offset = resp.buckets(b).param_offset();
    opt->buckets_.push_back(bk);
  }
  const std::pair<const char*, std::shared_ptr<Region>*> maps[] = {{"opt/control", &opt->control_},
                                                                   {"opt/master", &opt->master_},
                                                                   {"opt/grads", &opt->grads_},
                                                                   {"opt/params", &opt->params_}};
  for (const auto& [name, slot] : maps) {
    if (slot == &opt->params_ && resp.params_in_master()) {
      opt->params_ = opt->master_;  // fp32 parameters: their slots are the masters
      continue;
    }
    auto r = Map(name);
    if (!r.ok()) return r.status();
    *slot = *r;
  }
  if (opt->world_ > 1) {
    const auto groups = static_cast<uint32_t>(opt->groups_);
    const auto buckets = static_cast<uint32_t>(opt->buckets_.size());
    if (opt->control_->size() < wire::ControlPageBytes(groups, buckets, opt->world_)) {
      return absl::InternalError(absl::StrCat("tsd's control page (", opt->control_->size(),
                                              " bytes) has no counter for each of ", opt->world_,
                                              " ranks (tsd is older than this client?)"));
    }
    // A rank continues its counter where the page has it (0 for a new job).
    opt->ContinueCommits(wire::ControlView::Of(opt->control_->data(), groups, buckets)
                             .ranks[opt->rank_]
                             .commit.load(std::memory_order_acquire));
  }
  if (resume) {
    if (static_cast<size_t>(resp.resume().bucket_steps_size()) != opt->buckets_.size()) {
      return absl::InternalError("tsd's resume report does not cover every bucket");
    }
    opt->ContinueCommits(resp.resume().committed());
    if (report != nullptr) {
      const v1::ResumeReport& r = resp.resume();
      report->bucket_steps.assign(r.bucket_steps().begin(), r.bucket_steps().end());
      report->committed = r.committed();
      report->rolled_back.assign(r.rolled_back().begin(), r.rolled_back().end());
      report->dropped_partial.assign(r.dropped_partial().begin(), r.dropped_partial().end());
    }
  }
  return opt;
}

absl::StatusOr<OptimizerLayout> Client::PlanOptimizer(const OptimizerSpec& spec) {
  const v1::RegisterOptimizerRequest req = RegistrationRequest(spec);
  v1::PlanOptimizerResponse r;
  TSD_RETURN_IF_ERROR(impl_->Unary(&v1::Tsd::Stub::PlanOptimizer, req, &r));
  if (static_cast<size_t>(r.buckets_size()) != spec.buckets.size()) {
    return absl::InternalError(absl::StrCat("tsd planned ", r.buckets_size(), " buckets for ",
                                            spec.buckets.size(), " (version mismatch?)"));
  }
  OptimizerLayout out;
  for (const auto& b : r.buckets())
    out.buckets.push_back({b.master_offset(), b.grad_offset(), b.param_offset()});
  out.state_bytes = r.state_bytes();
  out.control_bytes = r.control_bytes();
  out.master_bytes = r.master_bytes();
  out.moment_bytes = r.moment_bytes();
  out.grad_bytes = r.grad_bytes();
  out.param_bytes = r.param_bytes();
  out.accum_bytes = r.accum_bytes();
  out.params_in_master = r.params_in_master();
  return out;
}

absl::StatusOr<uint64_t> Client::StateRequest(bool save, int fd,
                                              absl::Span<const uint32_t> buckets) {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  if (save) {
    req.mutable_save_state()->mutable_buckets()->Add(buckets.begin(), buckets.end());
  } else {
    req.mutable_load_state();
  }
  TSD_ASSIGN_OR_RETURN(auto reply, impl_->Call(std::move(req), fd,
                                               std::max(impl_->request_timeout, kMinStateTimeout),
                                               save ? "save_state" : "load_state"));
  if (reply.second >= 0) close(reply.second);
  return reply.first.state().bytes();
}

absl::StatusOr<std::pair<uint64_t, uint32_t>> Client::RetireRequest(
    absl::Span<const uint32_t> buckets, bool masters_unpinned) {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  req.mutable_retire_buckets()->mutable_buckets()->Add(buckets.begin(), buckets.end());
  req.mutable_retire_buckets()->set_masters_unpinned(masters_unpinned);
  // Punching many GiB out of the regions takes a while: the state requests' timeout.
  TSD_ASSIGN_OR_RETURN(auto reply, impl_->Call(std::move(req), -1,
                                               std::max(impl_->request_timeout, kMinStateTimeout),
                                               "retire_buckets"));
  if (reply.second >= 0) close(reply.second);
  return std::make_pair(reply.first.retire().released_bytes(), reply.first.retire().retired());
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::ResumeOptimizer(const OptimizerSpec& spec,
                                                                   ResumeReport* report) {
  return Register(spec, /*resume=*/true, report);
}

absl::StatusOr<uint64_t> Client::Checkpoint(const std::string& job, int fd) {
  MutexLock lock(impl_->mu);
  v1::SideRequest req;
  req.mutable_checkpoint()->set_job(job);
  auto reply = impl_->CallAlone(std::move(req), fd,
                                std::max(impl_->request_timeout, kMinStateTimeout), "Checkpoint()");
  if (!reply.ok()) return reply.status();
  if (reply->second >= 0) close(reply->second);
  return reply->first.state().bytes();
}

}  // namespace tsd
