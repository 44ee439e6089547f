// tsd declares the few CUDA driver types it uses itself (daemon/cuda/driver_api.h), so it builds
// without the toolkit; where the toolkit is installed, this checks them against cuda.h. cuda.h is
// included after tsd's header and no DriverApi member is used here: its macros (cuMemcpyHtoD ->
// cuMemcpyHtoD_v2, ...) would rename them.
#include <cstddef>

#include <gtest/gtest.h>

#include "daemon/cuda/driver_api.h"

#if __has_include(<cuda.h>)
#include <cuda.h>

namespace tsd {
namespace {

// The driver ABI tsd declares itself (so it builds without the toolkit) is cuda.h's.
TEST(CudaDriverApi, TheDeclaredAbiMatchesCudaH) {
  namespace abi = cuda::abi;
  static_assert(sizeof(abi::CUmemAllocationProp) == sizeof(CUmemAllocationProp));
  static_assert(offsetof(abi::CUmemAllocationProp, location) ==
                offsetof(CUmemAllocationProp, location));
  static_assert(offsetof(abi::CUmemAllocationProp, win32HandleMetaData) ==
                offsetof(CUmemAllocationProp, win32HandleMetaData));
  static_assert(offsetof(abi::CUmemAllocationProp, allocFlags) ==
                offsetof(CUmemAllocationProp, allocFlags));
  static_assert(sizeof(abi::CUmemAccessDesc) == sizeof(CUmemAccessDesc));
  static_assert(offsetof(abi::CUmemAccessDesc, flags) == offsetof(CUmemAccessDesc, flags));
  static_assert(sizeof(abi::CUmemLocation) == sizeof(CUmemLocation));
  static_assert(sizeof(abi::CUuuid) == sizeof(CUuuid));
  static_assert(sizeof(abi::CUdeviceptr) == sizeof(CUdeviceptr));
  static_assert(sizeof(abi::CUmemGenericAllocationHandle) == sizeof(CUmemGenericAllocationHandle));
  static_assert(abi::kSuccess == CUDA_SUCCESS);
  static_assert(abi::kErrorInvalidValue == CUDA_ERROR_INVALID_VALUE);
  static_assert(abi::kErrorOutOfMemory == CUDA_ERROR_OUT_OF_MEMORY);
  static_assert(abi::kErrorNotSupported == CUDA_ERROR_NOT_SUPPORTED);
  static_assert(abi::kAttrVirtualMemoryManagementSupported ==
                CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  static_assert(abi::kAttrHandleTypePosixFdSupported ==
                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  static_assert(abi::kAllocationTypePinned == CU_MEM_ALLOCATION_TYPE_PINNED);
  static_assert(abi::kHandleTypePosixFd == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  static_assert(abi::kLocationTypeDevice == CU_MEM_LOCATION_TYPE_DEVICE);
  static_assert(abi::kAccessProtRead == CU_MEM_ACCESS_FLAGS_PROT_READ);
  static_assert(abi::kAccessProtReadWrite == CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
  static_assert(abi::kGranularityMinimum == CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  static_assert(abi::kGranularityRecommended == CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  SUCCEED();
}

}  // namespace
}  // namespace tsd
#endif
