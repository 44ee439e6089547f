#include "cuda_host.h"

#include "absl/strings/str_cat.h"

#ifdef TSD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tsd::cuda_host {

#ifdef TSD_HAVE_CUDA
bool CudaHostAvailable() {
  static const bool available = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return available;
}

absl::Status Register(void* ptr, size_t bytes) {
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterDefault);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaHostRegister of ", bytes, " bytes failed: ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

void Unregister(void* ptr) { cudaHostUnregister(ptr); }
#else
bool CudaHostAvailable() { return false; }
absl::Status Register(void*, size_t) {
  return absl::UnimplementedError("tsclient was built without CUDA");
}
void Unregister(void*) {}
#endif

}  // namespace tsd::cuda_host
