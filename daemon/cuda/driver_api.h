// DriverApi is the handful of CUDA driver entry points that device copies of weight stores need
// (docs/stores.md, "Device copies"), loaded at run time: dlopen("libcuda.so.1") and dlsym of
// each entry point. Nothing links libcuda, so tsd and the Python package build, install and run
// on machines without an NVIDIA driver; there, Load() fails with a clear status and callers
// refuse only what needs a GPU.
//
// The few driver types used are declared here (namespace `abi`) rather than taken from cuda.h,
// so the code compiles without the CUDA toolkit too. They are the driver's stable C ABI (the
// layouts of CUDA 11.2 and later); tests/cpp/cuda_driver_test.cc checks each against cuda.h
// wherever the toolkit is installed.
//
// Thread safety: a loaded DriverApi is immutable; the driver's calls are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tsd::cuda {

namespace abi {
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUdeviceptr = unsigned long long;
using CUmemGenericAllocationHandle = unsigned long long;

constexpr CUresult kSuccess = 0;
constexpr CUresult kErrorInvalidValue = 1;
constexpr CUresult kErrorOutOfMemory = 2;
constexpr CUresult kErrorNotSupported = 801;

constexpr int kAttrVirtualMemoryManagementSupported = 102;
constexpr int kAttrHandleTypePosixFdSupported = 103;

constexpr int kAllocationTypePinned = 1;
constexpr int kHandleTypePosixFd = 1;
constexpr int kLocationTypeDevice = 1;
constexpr int kAccessProtRead = 1;
constexpr int kAccessProtReadWrite = 3;
constexpr int kGranularityMinimum = 0;
constexpr int kGranularityRecommended = 1;

struct CUuuid {
  char bytes[16];
};
struct CUmemLocation {
  int type;
  int id;
};
struct CUmemAllocationProp {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;
};
}  // namespace abi

struct DriverApi {
  // Loads `library` (the driver, libcuda.so.1, unless a test names another) and every entry point
  // below, then calls cuInit(0). FAILED_PRECONDITION saying what is missing when the library is
  // absent (no NVIDIA driver), lacks an entry point (a driver older than CUDA 11.4) or cuInit
  // fails (e.g. no GPU, or device nodes the process may not open).
  static absl::StatusOr<std::shared_ptr<const DriverApi>> Load(
      const std::string& library = "libcuda.so.1");
  // The driver of this process, loaded once (the first call's result is kept, success or not).
  static absl::StatusOr<std::shared_ptr<const DriverApi>> Shared();

  // OK for CUDA_SUCCESS; else an error naming `what` and the driver's own message.
  absl::Status Check(abi::CUresult r, const char* what) const;
  // The ordinal (in this process's enumeration) of the GPU with `uuid` ("GPU-xxxxxxxx-xxxx-...",
  // the prefix and case optional); NOT_FOUND listing the GPUs there are.
  absl::StatusOr<int> FindDevice(const std::string& uuid) const;
  // The UUID of GPU `ordinal`, as nvidia-smi -L writes it ("GPU-" and 32 hex digits in 5 groups).
  absl::StatusOr<std::string> UuidOf(int ordinal) const;
  // How many GPUs this process sees.
  absl::StatusOr<int> DeviceCount() const;

  std::string library;
  int driver_version = 0;  // e.g. 13000 for CUDA 13.0
  void* handle = nullptr;  // from dlopen; never closed (the driver stays loaded)

  using CUresult = abi::CUresult;
  using CUdevice = abi::CUdevice;
  using CUdeviceptr = abi::CUdeviceptr;
  using Handle = abi::CUmemGenericAllocationHandle;
  CUresult (*cuInit)(unsigned int) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetUuid)(abi::CUuuid*, CUdevice) = nullptr;  // cuDeviceGetUuid_v2
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(abi::CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;  // _v2
  CUresult (*cuCtxSetCurrent)(abi::CUcontext) = nullptr;
  CUresult (*cuCtxGetCurrent)(abi::CUcontext*) = nullptr;
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const abi::CUmemAllocationProp*,
                                            int) = nullptr;
  CUresult (*cuMemCreate)(Handle*, size_t, const abi::CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(Handle) = nullptr;
  CUresult (*cuMemExportToShareableHandle)(void*, Handle, int, unsigned long long) = nullptr;
  CUresult (*cuMemImportFromShareableHandle)(Handle*, void*, int) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, Handle, unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const abi::CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;  // cuMemcpyHtoD_v2
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;        // cuMemcpyDtoH_v2
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t) = nullptr;  // cuMemsetD8_v2
  CUresult (*cuCtxSynchronize)() = nullptr;
};

// Normalises a GPU UUID to nvidia-smi's form ("GPU-" + lower-case hex in 8-4-4-4-12 groups);
// INVALID_ARGUMENT unless `uuid` is 32 hex digits, optionally with "GPU-" and the dashes.
absl::StatusOr<std::string> NormalizeGpuUuid(const std::string& uuid);

}  // namespace tsd::cuda
