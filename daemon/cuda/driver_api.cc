#include "daemon/cuda/driver_api.h"

#include <dlfcn.h>

#include <cctype>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tsd::cuda {
namespace {

template <typename Fn>
absl::Status Resolve(void* handle, const std::string& library, const char* name, Fn& fn) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        library, " has no entry point ", name,
        ": the NVIDIA driver is older than device copies of stores need (CUDA 11.4 or later)"));
  }
  fn = reinterpret_cast<Fn>(sym);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> NormalizeGpuUuid(const std::string& uuid) {
  std::string hex;
  std::string_view rest = uuid;
  if (rest.size() >= 4 && (rest.substr(0, 4) == "GPU-" || rest.substr(0, 4) == "gpu-")) {
    rest.remove_prefix(4);
  }
  for (char c : rest) {
    if (c == '-') continue;
    if (!std::isxdigit(static_cast<unsigned char>(c)) || hex.size() >= 32) {
      hex.clear();
      break;
    }
    hex.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", uuid.substr(0, 64),
        "' is not a GPU UUID: give it as nvidia-smi -L shows it, GPU- and 32 hex digits "
        "(e.g. GPU-5c1b3b8e-0b3a-8f2e-6c1d-2a6e9c7f0d11)"));
  }
  return absl::StrCat("GPU-", hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-",
                      hex.substr(16, 4), "-", hex.substr(20, 12));
}

absl::StatusOr<std::shared_ptr<const DriverApi>> DriverApi::Load(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("the CUDA driver (", library, ") cannot be loaded (", why ? why : "not found",
                     "): this machine has no NVIDIA driver, or it is not on the loader's path"));
  }
  auto api = std::make_shared<DriverApi>();
  api->library = library;
  api->handle = handle;
  absl::Status s = [&]() -> absl::Status {
#define TSD_RESOLVE(field, name)                                              \
  if (absl::Status r = Resolve(handle, library, name, api->field); !r.ok()) { \
    return r;                                                                 \
  }
    TSD_RESOLVE(cuInit, "cuInit");
    TSD_RESOLVE(cuDriverGetVersion, "cuDriverGetVersion");
    TSD_RESOLVE(cuGetErrorString, "cuGetErrorString");
    TSD_RESOLVE(cuDeviceGetCount, "cuDeviceGetCount");
    TSD_RESOLVE(cuDeviceGet, "cuDeviceGet");
    TSD_RESOLVE(cuDeviceGetUuid, "cuDeviceGetUuid_v2");
    TSD_RESOLVE(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    TSD_RESOLVE(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    TSD_RESOLVE(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    TSD_RESOLVE(cuCtxSetCurrent, "cuCtxSetCurrent");
    TSD_RESOLVE(cuCtxGetCurrent, "cuCtxGetCurrent");
    TSD_RESOLVE(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    TSD_RESOLVE(cuMemCreate, "cuMemCreate");
    TSD_RESOLVE(cuMemRelease, "cuMemRelease");
    TSD_RESOLVE(cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
    TSD_RESOLVE(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
    TSD_RESOLVE(cuMemAddressReserve, "cuMemAddressReserve");
    TSD_RESOLVE(cuMemAddressFree, "cuMemAddressFree");
    TSD_RESOLVE(cuMemMap, "cuMemMap");
    TSD_RESOLVE(cuMemUnmap, "cuMemUnmap");
    TSD_RESOLVE(cuMemSetAccess, "cuMemSetAccess");
    TSD_RESOLVE(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
    TSD_RESOLVE(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
    TSD_RESOLVE(cuMemsetD8, "cuMemsetD8_v2");
    TSD_RESOLVE(cuCtxSynchronize, "cuCtxSynchronize");
#undef TSD_RESOLVE
    return absl::OkStatus();
  }();
  if (!s.ok()) {
    dlclose(handle);
    return s;
  }
  if (absl::Status init = api->Check(api->cuInit(0), "cuInit"); !init.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the CUDA driver is installed but does not start (", init.message(),
        "): no usable GPU, or the process may not open /dev/nvidia* (see docs/deploy.md)"));
  }
  api->cuDriverGetVersion(&api->driver_version);
  return std::shared_ptr<const DriverApi>(std::move(api));
}

absl::StatusOr<std::shared_ptr<const DriverApi>> DriverApi::Shared() {
  static std::once_flag once;
  static absl::StatusOr<std::shared_ptr<const DriverApi>>* loaded = nullptr;
  std::call_once(once,
                 [] { loaded = new absl::StatusOr<std::shared_ptr<const DriverApi>>(Load()); });
  return *loaded;
}

absl::Status DriverApi::Check(abi::CUresult r, const char* what) const {
  if (r == abi::kSuccess) return absl::OkStatus();
  const char* msg = nullptr;
  if (cuGetErrorString == nullptr || cuGetErrorString(r, &msg) != abi::kSuccess) msg = nullptr;
  const std::string text =
      absl::StrCat(what, " failed: CUDA error ", r, " (", msg ? msg : "unknown error", ")");
  switch (r) {
    case abi::kErrorOutOfMemory:
      return absl::ResourceExhaustedError(text);
    case abi::kErrorInvalidValue:
      return absl::InvalidArgumentError(text);
    case abi::kErrorNotSupported:
      return absl::FailedPreconditionError(text);
    default:
      return absl::InternalError(text);
  }
}

absl::StatusOr<int> DriverApi::DeviceCount() const {
  int n = 0;
  if (absl::Status s = Check(cuDeviceGetCount(&n), "cuDeviceGetCount"); !s.ok()) return s;
  return n;
}

absl::StatusOr<std::string> DriverApi::UuidOf(int ordinal) const {
  CUdevice dev = 0;
  if (absl::Status s = Check(cuDeviceGet(&dev, ordinal), "cuDeviceGet"); !s.ok()) return s;
  abi::CUuuid id{};
  if (absl::Status s = Check(cuDeviceGetUuid(&id, dev), "cuDeviceGetUuid"); !s.ok()) return s;
  static const char* kHex = "0123456789abcdef";
  std::string hex;
  for (char b : id.bytes) {
    const auto v = static_cast<unsigned char>(b);
    hex.push_back(kHex[v >> 4]);
    hex.push_back(kHex[v & 15]);
  }
  return NormalizeGpuUuid(hex);
}

absl::StatusOr<int> DriverApi::FindDevice(const std::string& uuid) const {
  absl::StatusOr<std::string> want = NormalizeGpuUuid(uuid);
  if (!want.ok()) return want.status();
  absl::StatusOr<int> count = DeviceCount();
  if (!count.ok()) return count.status();
  std::vector<std::string> seen;
  for (int i = 0; i < *count; ++i) {
    absl::StatusOr<std::string> got = UuidOf(i);
    if (!got.ok()) return got.status();
    if (*got == *want) return i;  // a CUdevice is its ordinal
    seen.push_back(*got);
  }
  return absl::NotFoundError(absl::StrCat("no GPU with UUID ", *want, " here; this process sees ",
                                          *count, *count == 1 ? " GPU" : " GPUs",
                                          seen.empty() ? "" : ": ", absl::StrJoin(seen, ", ")));
}

}  // namespace tsd::cuda
