// The Registrar sets up a job's optimizer engine for a session: it checks and lays out the
// request (JobOptimizer::Plan), allocates the optimizer's regions in the job one by one (charged to
// its quota and the pool), builds the JobOptimizer over them and installs it in the job. It sits
// above the Registry (daemon/jobs), which only keeps the books.
//
// Registration is all or nothing. When any step fails, including because the registering session
// died half-way (its connection closed, so the Registry no longer knows it), the rollback releases
// every `opt/*` region this registration allocated, by job rather than by session, so the job's
// usage is what it was before and a later registration of the job can succeed. A job that was
// released meanwhile took its regions with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/statusor.h"
#include "daemon/jobs/registry.h"
#include "proto/tsd.pb.h"

namespace tsd {

class Registrar final {
 public:
  // A test seam: called after each region is allocated, with how many are; a failure it returns
  // makes the registration fail there (and roll back).
  using AfterAlloc = std::function<absl::Status(size_t allocated)>;

  explicit Registrar(Registry& registry, AfterAlloc after_alloc = nullptr)
      : registry_(registry), after_alloc_(std::move(after_alloc)) {}

  // Registers the optimizer of `session_id`'s job and returns its layout. With world > 1 (data
  // parallel) a rank joins the job's optimizer when another rank created it (Registry::
  // JoinOptimizer: nothing is allocated), else creates it for the world.
  absl::StatusOr<v1::RegisterOptimizerResponse> Register(uint64_t session_id,
                                                         const v1::RegisterOptimizerRequest& req);

 private:
  // A registration with `resume`: takes over the job's kept optimizer when `req` matches it,
  // settles it (JobOptimizer::Resume) and returns its layout with the report
  // (daemon/optimizer/resume.cc). Allocates nothing.
  absl::StatusOr<v1::RegisterOptimizerResponse> Resume(uint64_t session_id,
                                                       const v1::RegisterOptimizerRequest& req);

  // The answer to a registration: where each bucket's master, gradient and parameter slots are,
  // the state's size, the kernels' ISA and the workers (a new registration and a resume alike).
  static v1::RegisterOptimizerResponse LayoutResponse(const OptimizerPlan& layout,
                                                      const RegistryOptions& options);

  Registry& registry_;
  const AfterAlloc after_alloc_;
};

}  // namespace tsd
