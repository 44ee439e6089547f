// Registration of host memory with CUDA, where the client was built with CUDA and a GPU is
// present at run time. Without either, `CudaHostAvailable()` is false and nothing is registered.
#pragma once

#include <cstddef>

#include "absl/status/status.h"

namespace tsd::cuda_host {

bool CudaHostAvailable();
absl::Status Register(void* ptr, size_t bytes);
void Unregister(void* ptr);

}  // namespace tsd::cuda_host
