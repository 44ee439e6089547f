// PrimaryContext retains a GPU's primary context (the one the CUDA runtime, hence torch, uses) for
// as long as it lives, and makes it current on the calling thread for a scope (Enter), restoring
// what was current before. Device copies of stores and their mappings use it so that tsd and a
// trainer share the runtime's context instead of creating one of their own.
//
// Thread safety: one PrimaryContext may be shared by threads; each Enter scope is per thread.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/cuda/driver_api.h"

namespace tsd::cuda {

class PrimaryContext final {
 public:
  // Retains the primary context of GPU `ordinal`.
  static absl::StatusOr<std::shared_ptr<PrimaryContext>> Retain(
      std::shared_ptr<const DriverApi> api, int ordinal);
  ~PrimaryContext();  // releases the context
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;

  // Makes the context current on this thread until the returned scope ends.
  class Scope final {
   public:
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    friend class PrimaryContext;
    Scope(const DriverApi& api, abi::CUcontext previous) : api_(api), previous_(previous) {}
    const DriverApi& api_;
    abi::CUcontext previous_;
  };
  absl::StatusOr<std::unique_ptr<Scope>> Enter() const;

  const DriverApi& api() const { return *api_; }
  int ordinal() const { return ordinal_; }

 private:
  PrimaryContext(std::shared_ptr<const DriverApi> api, int ordinal, abi::CUcontext ctx)
      : api_(std::move(api)), ordinal_(ordinal), ctx_(ctx) {}
  std::shared_ptr<const DriverApi> api_;
  int ordinal_;
  abi::CUcontext ctx_;
};

}  // namespace tsd::cuda
