#include "daemon/cuda/primary_context.h"

namespace tsd::cuda {

absl::StatusOr<std::shared_ptr<PrimaryContext>> PrimaryContext::Retain(
    std::shared_ptr<const DriverApi> api, int ordinal) {
  abi::CUcontext ctx = nullptr;
  if (absl::Status s =
          api->Check(api->cuDevicePrimaryCtxRetain(&ctx, ordinal), "cuDevicePrimaryCtxRetain");
      !s.ok()) {
    return s;
  }
  return std::shared_ptr<PrimaryContext>(new PrimaryContext(std::move(api), ordinal, ctx));
}

PrimaryContext::~PrimaryContext() { api_->cuDevicePrimaryCtxRelease(ordinal_); }

absl::StatusOr<std::unique_ptr<PrimaryContext::Scope>> PrimaryContext::Enter() const {
  abi::CUcontext previous = nullptr;
  if (absl::Status s = api_->Check(api_->cuCtxGetCurrent(&previous), "cuCtxGetCurrent"); !s.ok()) {
    return s;
  }
  if (absl::Status s = api_->Check(api_->cuCtxSetCurrent(ctx_), "cuCtxSetCurrent"); !s.ok()) {
    return s;
  }
  return std::unique_ptr<Scope>(new Scope(*api_, previous));
}

PrimaryContext::Scope::~Scope() { api_.cuCtxSetCurrent(previous_); }

}  // namespace tsd::cuda
