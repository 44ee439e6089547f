// trainstream._C: the Python binding of tsclient (client-cpp), the glue between torch and tsd.
//
// It exposes three classes and the facts both sides of the C++/Python line must agree on:
//   * Client: connect, attach, detach, status, jobs, alloc / map / free / list_regions,
//     plan_optimizer (the daemon's dry run of a registration) and register_optimizer (the C++
//     tsd::Client).
//   * Region: a region of tsd memory mapped here, with byte views as torch tensors over the
//     mapping (torch::from_blob, no copies). A region is freed only while no view is alive:
//     the daemon zeroes freed memory, so a live view would silently read zeros.
//   * Optimizer: the slots of a registered optimizer as torch tensors that alias the shared
//     memory (torch::from_blob, no copies), and the hot-path calls (ready, wait, commit, state).
//   * Store: a weight store (tsd/store.h) mapped here read-only, its tensor table, and byte views
//     over it as torch uint8 tensors (no copies; the mapping lives while a view does). Writing
//     through such a view faults: callers copy what they will modify.
//   * DeviceStore: a store's device copy (tsd/device_store.h, tsd's gpu_stores) mapped here on one
//     GPU, with byte views as CUDA uint8 tensors over the device memory (torch::for_blob with the
//     GPU as target device, no copies; the mapping lives while a view does). The CUDA driver is
//     loaded at run time by tsclient, so this still builds and imports without a GPU.
//   * DTYPES (name -> bytes: the dtypes tsd's optimizer takes), PAGE_BYTES and
//     control_page_bytes(groups, buckets), taken from the C++ headers, so Python keeps no copy.
// Errors are absl::Status values; they cross into Python as trainstream's TsdError subclasses
// (trainstream/errors.py picks the class from the status code), never as a bare RuntimeError.
//
// CUDA: this file is compiled without CUDA headers, so one wheel builds on machines with and
// without a GPU. `ready_on_stream` rings a bucket's doorbell from the GPU's own queue: it looks
// up cudaLaunchHostFunc in the CUDA runtime torch has already loaded (dlsym) and enqueues a host
// function that calls Optimizer::Ready once the stream's earlier work (the D2H copy of that
// bucket's gradient) is done.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/control_page.h"
#include "proto/state_format.h"
#include "proto/wire.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace py = pybind11;

namespace {

// A failed absl::Status on its way to Python; translated by the exception translator below.
struct StatusError {
  int code;
  std::string message;
};

[[noreturn]] void Throw(const absl::Status& s) {
  throw StatusError{static_cast<int>(s.code()), std::string(s.message())};
}
void Check(const absl::Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Value(absl::StatusOr<T> v) {
  if (!v.ok()) Throw(v.status());
  return std::move(*v);
}

// The one table of the dtypes tsd's optimizer takes: their names on the Python side (torch's) and
// their enum on the C++ side; sizes come from tsd::DTypeBytes.
struct DTypeName {
  const char* name;
  tsd::DType dtype;
};
constexpr DTypeName kDTypes[] = {
    {"float32", tsd::DType::kF32}, {"bfloat16", tsd::DType::kBF16}, {"float16", tsd::DType::kF16}};

tsd::DType DTypeOf(const std::string& name) {
  std::string names;
  for (const auto& d : kDTypes) {
    if (name == d.name) return d.dtype;
    names += names.empty() ? d.name : std::string(", ") + d.name;
  }
  Throw(absl::InvalidArgumentError("dtype must be one of " + names + ", not " + name));
}

at::ScalarType ScalarTypeOf(tsd::DType d) {
  switch (d) {
    case tsd::DType::kF32:
      return at::kFloat;
    case tsd::DType::kBF16:
      return at::kBFloat16;
    case tsd::DType::kF16:
      return at::kHalf;
  }
  return at::kFloat;
}

// A weight store mapped here; byte views hold a reference to the mapping.
struct StoreHandle {
  std::shared_ptr<tsd::StoreView> view;
};

torch::Tensor StoreBytes(const StoreHandle& h, uint64_t offset, uint64_t nbytes) {
  const uint64_t size = h.view->size();
  if (offset > size || nbytes > size - offset) {
    Throw(absl::OutOfRangeError("bytes [" + std::to_string(offset) + ", +" +
                                std::to_string(nbytes) + ") are outside store " +
                                std::to_string(h.view->id()) + " of " + std::to_string(size) +
                                " bytes"));
  }
  auto keep = h.view;
  return torch::from_blob(
      const_cast<uint8_t*>(h.view->data()) + offset, {static_cast<int64_t>(nbytes)},
      [keep](void*) mutable { keep.reset(); }, torch::TensorOptions().dtype(torch::kUInt8));
}

// A store's device copy mapped here; byte views hold a reference to the mapping.
struct DeviceStoreHandle {
  std::shared_ptr<tsd::DeviceStoreView> view;
};

torch::Tensor DeviceStoreBytes(const DeviceStoreHandle& h, uint64_t offset, uint64_t nbytes) {
  const uint64_t size = h.view->data_bytes();
  if (offset > size || nbytes > size - offset) {
    Throw(absl::OutOfRangeError("bytes [" + std::to_string(offset) + ", +" +
                                std::to_string(nbytes) + ") are outside the device copy of store " +
                                std::to_string(h.view->store_id()) + " (" + std::to_string(size) +
                                " bytes)"));
  }
  auto keep = h.view;
  return torch::for_blob(reinterpret_cast<void*>(h.view->address() + offset),
                         {static_cast<int64_t>(nbytes)})
      .deleter([keep](void*) mutable { keep.reset(); })
      .options(torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA, h.view->device()))
      .target_device(c10::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(h.view->device())))
      .make_tensor();
}

py::dict StoreStatusDict(const tsd::StoreStatus& s) {
  py::dict d;
  d["id"] = s.id;
  d["source"] = s.source;
  d["format"] = s.format;
  d["block_size"] = s.block_size;
  d["bytes"] = s.bytes;
  d["users"] = s.users;
  d["idle_s"] = s.idle_s;
  d["digest"] = s.digest;
  d["tensors"] = s.tensors;
  py::list devices;
  for (const tsd::DeviceCopyStatus& c : s.device_copies) {
    py::dict dc;
    dc["gpu_uuid"] = c.gpu_uuid;
    dc["bytes"] = c.bytes;
    dc["users"] = c.users;
    dc["idle_s"] = c.idle_s;
    devices.append(dc);
  }
  d["device_copies"] = devices;
  return d;
}

// A Client shared by Python and by every Optimizer it registered: the optimizer's regions hold a
// pointer to the client, so the client must outlive them.
using ClientPtr = std::shared_ptr<tsd::Client>;

// An optimizer plus what keeps it valid. Tensors over its slots hold a reference to it, so the
// mapping outlives every tensor that aliases it.
struct OptimizerHandle {
  ClientPtr client;
  std::unique_ptr<tsd::Optimizer> opt;
  std::vector<tsd::DType> grad_dtypes, param_dtypes;
  // The first error of a doorbell rung from a CUDA host function (there is no caller to return
  // it to); reported by the next `take_async_error`.
  std::mutex async_mu;
  std::string async_error;
  int async_code = 0;
};
using HandlePtr = std::shared_ptr<OptimizerHandle>;

void CheckBucket(const OptimizerHandle& h, size_t b) {
  if (b >= h.opt->num_buckets()) {
    Throw(absl::InvalidArgumentError("bucket " + std::to_string(b) + " does not exist (" +
                                     std::to_string(h.opt->num_buckets()) + " buckets)"));
  }
}

at::Tensor Alias(const HandlePtr& h, void* data, int64_t numel, at::ScalarType type) {
  HandlePtr keep = h;
  return torch::from_blob(
      data, {numel}, [keep](void*) mutable { keep.reset(); },
      at::TensorOptions().dtype(type).device(at::kCPU));
}

absl::Duration Seconds(double s) { return s <= 0 ? absl::InfiniteDuration() : absl::Seconds(s); }

// ---- Regions ----------------------------------------------------------------------------------

// A mapped region plus the count of torch storages viewing it. Each view holds a reference to the
// region, so the mapping outlives every tensor over it; `free` refuses while views are alive.
struct RegionHandle {
  std::shared_ptr<tsd::Region> region;
  std::shared_ptr<std::atomic<int64_t>> views = std::make_shared<std::atomic<int64_t>>(0);
};
using RegionPtr = std::shared_ptr<RegionHandle>;

RegionPtr Wrap(std::shared_ptr<tsd::Region> r) {
  auto h = std::make_shared<RegionHandle>();
  h->region = std::move(r);
  return h;
}

// A uint8 tensor over bytes [offset, offset + nbytes) of the region.
at::Tensor RegionBytes(const RegionHandle& h, uint64_t offset, uint64_t nbytes) {
  const tsd::Region& r = *h.region;
  if (r.data() == nullptr) {
    Throw(absl::FailedPreconditionError("region '" + r.name() +
                                        "' was freed; allocate or map it again"));
  }
  if (offset > r.size() || nbytes > r.size() - offset) {
    Throw(absl::OutOfRangeError("bytes [" + std::to_string(offset) + ", " + std::to_string(offset) +
                                " + " + std::to_string(nbytes) + ") are outside region '" +
                                r.name() + "' of " + std::to_string(r.size()) + " bytes"));
  }
  std::shared_ptr<tsd::Region> keep = h.region;
  std::shared_ptr<std::atomic<int64_t>> views = h.views;
  views->fetch_add(1);
  return torch::from_blob(
      static_cast<char*>(r.data()) + offset, {static_cast<int64_t>(nbytes)},
      [keep, views](void*) mutable {
        views->fetch_sub(1);
        keep.reset();
      },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

py::dict RegionDict(const tsd::RegionDesc& r) {
  py::dict d;
  d["id"] = r.id;
  d["name"] = r.name;
  d["size"] = r.size;
  d["locked"] = r.locked;
  return d;
}

// The request of a registration (or of its dry run) from Python values. groups: list of dicts
// {lr, beta1, beta2, eps, weight_decay}; buckets: list of (group, numel, grad_dtype, param_dtype)
// with dtype names.
tsd::OptimizerSpec SpecOf(
    const std::vector<py::dict>& groups,
    const std::vector<std::tuple<uint32_t, uint64_t, std::string, std::string>>& buckets,
    const std::string& moment_dtype, double max_grad_norm, bool accumulate, uint64_t seed,
    bool amsgrad, bool maximize) {
  tsd::OptimizerSpec spec;
  for (const auto& g : groups) {
    tsd::GroupHyper h;
    h.lr = g["lr"].cast<double>();
    h.beta1 = g["beta1"].cast<double>();
    h.beta2 = g["beta2"].cast<double>();
    h.eps = g["eps"].cast<double>();
    h.weight_decay = g["weight_decay"].cast<double>();
    spec.groups.push_back(h);
  }
  for (const auto& [group, numel, gd, pd] : buckets) {
    spec.buckets.push_back({group, numel, DTypeOf(gd), DTypeOf(pd)});
  }
  spec.moment_dtype = DTypeOf(moment_dtype);
  spec.max_grad_norm = max_grad_norm;
  spec.accumulate = accumulate;
  spec.seed = seed;
  spec.amsgrad = amsgrad;
  spec.maximize = maximize;
  return spec;
}

// ---- Doorbells rung from a CUDA stream --------------------------------------------------------

using HostFn = void (*)(void*);
using LaunchHostFunc = int (*)(void* stream, HostFn fn, void* user_data);

LaunchHostFunc FindLaunchHostFunc() {
  static LaunchHostFunc fn = [] {
    void* sym = dlsym(RTLD_DEFAULT, "cudaLaunchHostFunc");
    if (sym == nullptr) {
      // torch loads the CUDA runtime with RTLD_GLOBAL; if that ever changes, open it by name.
      for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
        if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) {
          sym = dlsym(h, "cudaLaunchHostFunc");
          if (sym != nullptr) break;
        }
      }
    }
    return reinterpret_cast<LaunchHostFunc>(sym);
  }();
  return fn;
}

struct PendingReady {
  HandlePtr handle;
  size_t bucket;
  bool first, final;
};

void RunPendingReady(void* p) {
  std::unique_ptr<PendingReady> r(static_cast<PendingReady*>(p));
  const absl::Status s = r->handle->opt->Ready(r->bucket, r->first, r->final);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(r->handle->async_mu);
    if (r->handle->async_code == 0) {
      r->handle->async_code = static_cast<int>(s.code());
      r->handle->async_error = std::string(s.message());
    }
  }
  r->handle.reset();  // may free the handle; no CUDA call happens here (none is allowed)
}

// ---- Python-facing wrappers -------------------------------------------------------------------

py::dict StatusDict(const tsd::PoolStatus& s) {
  py::dict d;
  d["version"] = s.version;
  d["uptime_s"] = s.uptime_s;
  d["pool_bytes"] = s.pool_bytes;
  d["used_bytes"] = s.used_bytes;
  d["locked"] = s.locked;
  d["jobs"] = s.jobs;
  d["sessions"] = s.sessions;
  d["max_job_quota_bytes"] = s.max_job_quota_bytes;
  d["pid"] = s.pid;
  return d;
}

py::list JobsList(const std::vector<tsd::JobStatus>& jobs) {
  py::list out;
  for (const auto& j : jobs) {
    py::dict d;
    d["name"] = j.name;
    d["uid"] = j.uid;
    d["sessions"] = j.sessions;
    d["used_bytes"] = j.used_bytes;
    d["quota_bytes"] = j.quota_bytes;
    d["regions"] = j.regions;
    d["speculated_commits"] = j.activity.speculated_commits;
    d["redone_commits"] = j.activity.redone_commits;
    d["work_busy_s"] = j.activity.work_busy_s;
    d["work_busy_share"] = j.activity.work_busy_share;
    out.append(d);
  }
  return out;
}

// A handle for `spec`'s buckets (their dtypes) on `client`, before its optimizer is registered.
HandlePtr NewHandle(const ClientPtr& client, const tsd::OptimizerSpec& spec) {
  auto h = std::make_shared<OptimizerHandle>();
  for (const auto& b : spec.buckets) {
    h->grad_dtypes.push_back(b.grad_dtype);
    h->param_dtypes.push_back(b.param_dtype);
  }
  h->client = client;
  return h;
}

// `rank`/`world`: a data-parallel rank's registration (world > 1), which joins the job's
// optimizer when another rank created it (docs/distributed.md).
HandlePtr RegisterOptimizer(
    const ClientPtr& client, const std::vector<py::dict>& groups,
    const std::vector<std::tuple<uint32_t, uint64_t, std::string, std::string>>& buckets,
    const std::string& moment_dtype, double max_grad_norm, bool accumulate, uint64_t seed,
    bool amsgrad, bool maximize, uint32_t rank, uint32_t world, const std::string& pci_bus_id,
    bool hold_clipped_updates) {
  tsd::OptimizerSpec spec =
      SpecOf(groups, buckets, moment_dtype, max_grad_norm, accumulate, seed, amsgrad, maximize);
  spec.rank = rank;
  spec.world = world;
  spec.pci_bus_id = pci_bus_id;  // the GPU's, for NUMA placement (tsd checks it)
  spec.hold_clipped_updates = hold_clipped_updates;  // wrap(clip_speculation=False)
  auto h = NewHandle(client, spec);
  {
    py::gil_scoped_release release;
    h->opt = Value(client->RegisterOptimizer(spec));
  }
  return h;
}

// A resume registration: the handle and the report of where the kept optimizer stands.
py::tuple ResumeOptimizer(
    const ClientPtr& client, const std::vector<py::dict>& groups,
    const std::vector<std::tuple<uint32_t, uint64_t, std::string, std::string>>& buckets,
    const std::string& moment_dtype, double max_grad_norm, bool accumulate, uint64_t seed,
    bool amsgrad, bool maximize, uint32_t rank, uint32_t world) {
  tsd::OptimizerSpec spec =
      SpecOf(groups, buckets, moment_dtype, max_grad_norm, accumulate, seed, amsgrad, maximize);
  spec.rank = rank;  // data parallel: each rank of a restarted group resumes (tsd checks world)
  spec.world = world;
  auto h = NewHandle(client, spec);
  tsd::ResumeReport report;
  {
    py::gil_scoped_release release;
    h->opt = Value(client->ResumeOptimizer(spec, &report));
  }
  py::dict d;
  d["bucket_steps"] = report.bucket_steps;
  d["committed"] = report.committed;
  d["rolled_back"] = report.rolled_back;
  d["dropped_partial"] = report.dropped_partial;
  return py::make_tuple(h, d);
}

// The daemon's dry run of a registration, as a dict: state_bytes, the per-region bytes and the
// buckets' offsets.
py::dict PlanOptimizer(
    tsd::Client& client, const std::vector<py::dict>& groups,
    const std::vector<std::tuple<uint32_t, uint64_t, std::string, std::string>>& buckets,
    const std::string& moment_dtype, double max_grad_norm, bool accumulate, uint64_t seed,
    bool amsgrad, bool maximize) {
  const tsd::OptimizerSpec spec =
      SpecOf(groups, buckets, moment_dtype, max_grad_norm, accumulate, seed, amsgrad, maximize);
  tsd::OptimizerLayout l;
  {
    py::gil_scoped_release release;
    l = Value(client.PlanOptimizer(spec));
  }
  py::dict d;
  d["state_bytes"] = l.state_bytes;
  d["control_bytes"] = l.control_bytes;
  d["master_bytes"] = l.master_bytes;
  d["moment_bytes"] = l.moment_bytes;
  d["grad_bytes"] = l.grad_bytes;
  d["param_bytes"] = l.param_bytes;
  d["accum_bytes"] = l.accum_bytes;
  py::list offsets;
  for (const auto& b : l.buckets)
    offsets.append(py::make_tuple(b.master_offset, b.grad_offset, b.param_offset));
  d["buckets"] = offsets;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "trainstream's binding of tsclient, the C++ client of the TrainStream daemon (tsd)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      py::gil_scoped_acquire gil;
      py::object errors = py::module_::import("trainstream.errors");
      py::object cls = errors.attr("error_class")(e.code);
      PyErr_SetObject(cls.ptr(), cls(e.message, e.code).ptr());
    }
  });

  py::dict dtypes;
  for (const auto& d : kDTypes) dtypes[d.name] = tsd::DTypeBytes(d.dtype);
  m.attr("DTYPES") = dtypes;
  m.attr("PAGE_BYTES") = tsd::wire::kPageBytes;
  m.attr("STATE_FORMAT") = std::string(tsd::wire::kStateFormat);
  py::tuple parts(tsd::wire::kStateParts.size());
  for (size_t i = 0; i < tsd::wire::kStateParts.size(); ++i) {
    parts[i] = std::string(tsd::wire::kStateParts[i]);
  }
  m.attr("STATE_PARTS") = parts;
  m.def(
      "control_page_bytes",
      [](uint32_t groups, uint32_t buckets) {
        return tsd::wire::ControlPageBytes(groups, buckets);
      },
      py::arg("groups"), py::arg("buckets"));

  py::class_<RegionHandle, RegionPtr>(m, "Region")
      .def_property_readonly("id", [](const RegionHandle& h) { return h.region->id(); })
      .def_property_readonly("name", [](const RegionHandle& h) { return h.region->name(); })
      .def_property_readonly("size", [](const RegionHandle& h) { return h.region->size(); })
      .def_property_readonly("locked", [](const RegionHandle& h) { return h.region->locked(); })
      .def_property_readonly("cuda_registered",
                             [](const RegionHandle& h) { return h.region->cuda_registered(); })
      .def_property_readonly("freed",
                             [](const RegionHandle& h) { return h.region->data() == nullptr; })
      .def_property_readonly("live_views", [](const RegionHandle& h) { return h.views->load(); })
      .def("bytes", &RegionBytes, py::arg("offset"), py::arg("nbytes"));

  py::class_<StoreHandle>(m, "Store")
      .def_property_readonly("id", [](const StoreHandle& h) { return h.view->id(); })
      .def_property_readonly("size", [](const StoreHandle& h) { return h.view->size(); })
      .def_property_readonly("built", [](const StoreHandle& h) { return h.view->built(); })
      .def_property_readonly("status",
                             [](const StoreHandle& h) { return StoreStatusDict(h.view->status()); })
      .def_property_readonly("tensors",
                             [](const StoreHandle& h) {
                               py::list out;
                               for (const tsd::StoreTensorView& t : h.view->tensors()) {
                                 py::dict d;
                                 d["name"] = t.name;
                                 d["dtype"] = t.dtype;
                                 d["shape"] = t.shape;
                                 d["quantized"] = t.quantized;
                                 d["offset"] = t.offset;
                                 d["bytes"] = t.bytes;
                                 d["absmax_offset"] = t.absmax_offset;
                                 d["absmax_count"] = t.absmax_count;
                                 out.append(d);
                               }
                               return out;
                             })
      .def("bytes", &StoreBytes, py::arg("offset"), py::arg("nbytes"));

  py::class_<DeviceStoreHandle>(m, "DeviceStore")
      .def_property_readonly("store_id",
                             [](const DeviceStoreHandle& h) { return h.view->store_id(); })
      .def_property_readonly("gpu_uuid",
                             [](const DeviceStoreHandle& h) { return h.view->gpu_uuid(); })
      .def_property_readonly("device", [](const DeviceStoreHandle& h) { return h.view->device(); })
      .def_property_readonly("size", [](const DeviceStoreHandle& h) { return h.view->size(); })
      .def_property_readonly("data_bytes",
                             [](const DeviceStoreHandle& h) { return h.view->data_bytes(); })
      .def_property_readonly("read_only",
                             [](const DeviceStoreHandle& h) { return h.view->read_only(); })
      .def_property_readonly("access_note",
                             [](const DeviceStoreHandle& h) { return h.view->access_note(); })
      .def("bytes", &DeviceStoreBytes, py::arg("offset"), py::arg("nbytes"));
  m.def(
      "gpu_uuid", [](int ordinal) { return Value(tsd::GpuUuid(ordinal)); }, py::arg("ordinal"),
      "The UUID of CUDA device `ordinal` of this process, as nvidia-smi -L shows it.");

  py::class_<tsd::Client, ClientPtr>(m, "Client")
      .def_static(
          "connect",
          [](const std::string& socket) {
            std::unique_ptr<tsd::Client> c;
            {
              py::gil_scoped_release release;
              c = Value(tsd::Client::Connect(socket));
            }
            return ClientPtr(std::move(c));
          },
          py::arg("socket") = "")
      .def(
          "attach",
          [](tsd::Client& c, const std::string& job, uint64_t quota, double keep_for_s,
             bool resume) {
            if (!(keep_for_s >= 0) || keep_for_s > 1e9) {
              Throw(absl::InvalidArgumentError("keep_for must be between 0 and 1e9 seconds"));
            }
            tsd::JobOptions options;
            options.keep_for = absl::Milliseconds(static_cast<int64_t>(keep_for_s * 1000.0));
            options.resume = resume;
            py::gil_scoped_release release;
            Check(c.Attach(job, quota, options));
          },
          py::arg("job"), py::arg("quota_bytes") = 0, py::arg("keep_for_s") = 0.0,
          py::arg("resume") = false)
      .def("checkpoint",
           [](tsd::Client& c, const std::string& job, int fd) {
             py::gil_scoped_release release;
             return Value(c.Checkpoint(job, fd));
           })
      .def_property_readonly(
          "keep_for_s", [](const tsd::Client& c) { return absl::ToDoubleSeconds(c.keep_for()); })
      .def_property_readonly("resumed", &tsd::Client::resumed)
      .def_property_readonly("orphaned_s", &tsd::Client::orphaned_s)
      .def("detach",
           [](tsd::Client& c) {
             py::gil_scoped_release release;
             Check(c.Detach());
           })
      .def("status",
           [](tsd::Client& c) {
             tsd::PoolStatus s;
             {
               py::gil_scoped_release release;
               s = Value(c.Status());
             }
             return StatusDict(s);
           })
      .def("jobs",
           [](tsd::Client& c) {
             std::vector<tsd::JobStatus> j;
             {
               py::gil_scoped_release release;
               j = Value(c.Jobs());
             }
             return JobsList(j);
           })
      .def(
          "alloc",
          [](tsd::Client& c, const std::string& name, uint64_t bytes) {
            std::shared_ptr<tsd::Region> r;
            {
              py::gil_scoped_release release;
              r = Value(c.Alloc(name, bytes));
            }
            return Wrap(std::move(r));
          },
          py::arg("name"), py::arg("bytes"))
      .def(
          "map",
          [](tsd::Client& c, const std::string& name) {
            std::shared_ptr<tsd::Region> r;
            {
              py::gil_scoped_release release;
              r = Value(c.Map(name));
            }
            return Wrap(std::move(r));
          },
          py::arg("name"))
      .def(
          "free",
          [](tsd::Client& c, const RegionHandle& h) {
            const int64_t views = h.views->load();
            if (views > 0) {
              Throw(absl::FailedPreconditionError(
                  "region '" + h.region->name() + "' still has " + std::to_string(views) +
                  " tensor view(s) over its memory; drop them before freeing it (tsd zeroes freed "
                  "memory, so they would read zeros)"));
            }
            py::gil_scoped_release release;
            Check(c.Free(h.region));
          },
          py::arg("region"))
      .def(
          "set_request_timeout",
          [](tsd::Client& c, double seconds) {
            if (!(seconds > 0) || seconds > 86400.0 * 365) {
              Throw(absl::InvalidArgumentError(
                  "request timeout must be a positive number of seconds (at most a year), got " +
                  std::to_string(seconds)));
            }
            c.SetRequestTimeout(absl::Seconds(seconds));
          },
          py::arg("seconds"))
      .def("last_notice",
           [](tsd::Client& c) -> py::object {
             std::optional<tsd::Notice> n;
             {
               py::gil_scoped_release release;
               n = c.LastNotice();
             }
             if (!n) return py::none();
             const char* kind = n->kind == tsd::Notice::Kind::kShutdown        ? "shutdown"
                                : n->kind == tsd::Notice::Kind::kSessionClosed ? "session_closed"
                                                                               : "other";
             py::dict d;
             d["kind"] = kind;
             d["message"] = n->message;
             return d;
           })
      .def("list_regions",
           [](tsd::Client& c) {
             std::vector<tsd::RegionDesc> regions;
             {
               py::gil_scoped_release release;
               regions = Value(c.ListRegions());
             }
             py::list out;
             for (const auto& r : regions) out.append(RegionDict(r));
             return out;
           })
      .def("plan_optimizer", &PlanOptimizer, py::arg("groups"), py::arg("buckets"),
           py::arg("moment_dtype") = "float32", py::arg("max_grad_norm") = 0.0,
           py::arg("accumulate") = false, py::arg("seed") = 0, py::arg("amsgrad") = false,
           py::arg("maximize") = false)
      .def("register_optimizer", &RegisterOptimizer, py::arg("groups"), py::arg("buckets"),
           py::arg("moment_dtype") = "float32", py::arg("max_grad_norm") = 0.0,
           py::arg("accumulate") = false, py::arg("seed") = 0, py::arg("amsgrad") = false,
           py::arg("maximize") = false, py::arg("rank") = 0, py::arg("world") = 0,
           py::arg("pci_bus_id") = "", py::arg("hold_clipped_updates") = false)
      .def("resume_optimizer", &ResumeOptimizer, py::arg("groups"), py::arg("buckets"),
           py::arg("moment_dtype") = "float32", py::arg("max_grad_norm") = 0.0,
           py::arg("accumulate") = false, py::arg("seed") = 0, py::arg("amsgrad") = false,
           py::arg("maximize") = false, py::arg("rank") = 0, py::arg("world") = 0)
      .def(
          "open_store",
          [](tsd::Client& c, const std::vector<std::string>& files, const std::string& format,
             uint32_t block_size, const std::vector<std::pair<std::string, bool>>& tensors) {
            tsd::StoreSpec spec;
            spec.format = format;
            spec.block_size = block_size;
            for (const auto& [name, quantize] : tensors) spec.tensors.push_back({name, quantize});
            StoreHandle h;
            {
              py::gil_scoped_release release;
              h.view = Value(c.OpenStore(files, spec));
            }
            return h;
          },
          py::arg("files"), py::arg("format") = "none", py::arg("block_size") = 64,
          py::arg("tensors") = std::vector<std::pair<std::string, bool>>{})
      .def(
          "open_device_store",
          [](tsd::Client& c, uint64_t id, const std::string& gpu_uuid) {
            DeviceStoreHandle h;
            {
              py::gil_scoped_release release;
              h.view = Value(c.OpenDeviceStore(id, gpu_uuid));
            }
            return h;
          },
          py::arg("store_id"), py::arg("gpu_uuid"))
      .def(
          "close_store",
          [](tsd::Client& c, uint64_t id) {
            py::gil_scoped_release release;
            Check(c.CloseStore(id));
          },
          py::arg("store_id"))
      .def("stores",
           [](tsd::Client& c) {
             std::vector<tsd::StoreStatus> stores;
             {
               py::gil_scoped_release release;
               stores = Value(c.Stores());
             }
             py::list out;
             for (const auto& s : stores) out.append(StoreStatusDict(s));
             return out;
           })
      .def_property_readonly("socket_path", &tsd::Client::socket_path)
      .def_property_readonly("attached", &tsd::Client::attached)
      .def_property_readonly("job", &tsd::Client::job)
      .def_property_readonly("quota_bytes", &tsd::Client::quota_bytes)
      .def_property_readonly("session_id", &tsd::Client::session_id);

  py::class_<OptimizerHandle, HandlePtr>(m, "Optimizer")
      .def_property_readonly("num_buckets",
                             [](const OptimizerHandle& h) { return h.opt->num_buckets(); })
      .def_property_readonly("num_groups",
                             [](const OptimizerHandle& h) { return h.opt->num_groups(); })
      .def_property_readonly("isa", [](const OptimizerHandle& h) { return h.opt->isa(); })
      .def_property_readonly("threads", [](const OptimizerHandle& h) { return h.opt->threads(); })
      .def_property_readonly("state_bytes",
                             [](const OptimizerHandle& h) { return h.opt->state_bytes(); })
      .def_property_readonly("last_grad_norm",
                             [](const OptimizerHandle& h) { return h.opt->last_grad_norm(); })
      .def("numel",
           [](const OptimizerHandle& h, size_t b) {
             CheckBucket(h, b);
             return h.opt->numel(b);
           })
      .def("steps",
           [](const OptimizerHandle& h, size_t b) {
             CheckBucket(h, b);
             return h.opt->steps(b);
           })
      .def("times",
           [](const OptimizerHandle& h, size_t b) {
             CheckBucket(h, b);
             const tsd::Optimizer::BucketTimes t = h.opt->times(b);
             return py::make_tuple(t.taken_ns, t.began_ns, t.ended_ns, t.published_ns);
           })
      .def(
          "wait_steps",
          [](OptimizerHandle& h, size_t b, uint32_t steps, double timeout_s) {
            CheckBucket(h, b);
            py::gil_scoped_release release;
            Check(h.opt->WaitSteps(b, steps, Seconds(timeout_s)));
          },
          py::arg("bucket"), py::arg("steps"), py::arg("timeout_s") = 600.0)
      .def_property_readonly("rank", [](const OptimizerHandle& h) { return h.opt->rank(); })
      .def_property_readonly("world", [](const OptimizerHandle& h) { return h.opt->world(); })
      // Tensors aliasing the shared slots (1-D, CPU; pinned where CUDA registered them).
      .def("master",
           [](const HandlePtr& h, size_t b) {
             CheckBucket(*h, b);
             return Alias(h, h->opt->master(b), static_cast<int64_t>(h->opt->numel(b)), at::kFloat);
           })
      .def("grad",
           [](const HandlePtr& h, size_t b) {
             CheckBucket(*h, b);
             return Alias(h, h->opt->grad(b), static_cast<int64_t>(h->opt->numel(b)),
                          ScalarTypeOf(h->grad_dtypes[b]));
           })
      .def("param",
           [](const HandlePtr& h, size_t b) {
             CheckBucket(*h, b);
             return Alias(h, const_cast<void*>(h->opt->param(b)),
                          static_cast<int64_t>(h->opt->numel(b)), ScalarTypeOf(h->param_dtypes[b]));
           })
      .def(
          "set_group",
          [](OptimizerHandle& h, size_t g, double lr, double beta1, double beta2, double eps,
             double wd) {
            if (g >= h.opt->num_groups())
              Throw(absl::InvalidArgumentError("group " + std::to_string(g) + " does not exist"));
            Check(h.opt->SetGroup(g, {lr, beta1, beta2, eps, wd}));
          },
          py::arg("group"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"))
      .def(
          "ready",
          [](OptimizerHandle& h, size_t b, bool first, bool final) {
            Check(h.opt->Ready(b, first, final));
          },
          py::arg("bucket"), py::arg("first") = true, py::arg("final") = true)
      .def(
          "ready_on_stream",
          [](const HandlePtr& h, uintptr_t stream, size_t b, bool first, bool final) {
            CheckBucket(*h, b);
            LaunchHostFunc launch = FindLaunchHostFunc();
            if (launch == nullptr) {
              Throw(absl::FailedPreconditionError(
                  "cudaLaunchHostFunc is not available: the CUDA runtime is not loaded"));
            }
            auto* r = new PendingReady{h, b, first, final};
            const int err = launch(reinterpret_cast<void*>(stream), &RunPendingReady, r);
            if (err != 0) {
              delete r;
              Throw(absl::InternalError("cudaLaunchHostFunc failed with CUDA error " +
                                        std::to_string(err)));
            }
          },
          py::arg("stream"), py::arg("bucket"), py::arg("first") = true, py::arg("final") = true)
      .def("take_async_error",
           [](OptimizerHandle& h) -> py::object {
             std::lock_guard<std::mutex> lock(h.async_mu);
             if (h.async_code == 0) return py::none();
             py::tuple t = py::make_tuple(h.async_code, h.async_error);
             h.async_code = 0;
             h.async_error.clear();
             return t;
           })
      .def(
          "wait",
          [](OptimizerHandle& h, size_t b, double timeout_s) {
            py::gil_scoped_release release;
            Check(h.opt->Wait(b, Seconds(timeout_s)));
          },
          py::arg("bucket"), py::arg("timeout_s") = 600.0)
      .def(
          "wait_all",
          [](OptimizerHandle& h, double timeout_s) {
            py::gil_scoped_release release;
            Check(h.opt->WaitAll(Seconds(timeout_s)));
          },
          py::arg("timeout_s") = 600.0)
      .def(
          "report_step",
          [](OptimizerHandle& h, double wait_s, uint64_t h2d_bytes, uint64_t d2h_bytes) {
            if (!std::isfinite(wait_s)) {
              throw py::value_error("report_step: wait_s must be a finite number of seconds");
            }
            Check(h.opt->ReportStep(absl::Seconds(wait_s), h2d_bytes, d2h_bytes));
          },
          py::arg("wait_s"), py::arg("h2d_bytes") = 0, py::arg("d2h_bytes") = 0)
      .def(
          "commit",
          [](OptimizerHandle& h, double timeout_s, bool wait) {
            py::gil_scoped_release release;
            Check(h.opt->Commit(Seconds(timeout_s), wait));
          },
          py::arg("timeout_s") = 600.0, py::arg("wait") = true)
      .def(
          "wait_committed",
          [](OptimizerHandle& h, double timeout_s) {
            py::gil_scoped_release release;
            Check(h.opt->WaitCommitted(Seconds(timeout_s)));
          },
          py::arg("timeout_s") = 600.0)
      .def(
          "set_order",
          [](OptimizerHandle& h, const std::vector<size_t>& forward) {
            Check(h.opt->SetOrder(forward));
          },
          py::arg("forward"))
      .def(
          "save_state",
          [](OptimizerHandle& h, int fd, const std::vector<uint32_t>& buckets) {
            py::gil_scoped_release release;
            return Value(h.opt->SaveState(fd, buckets));
          },
          py::arg("fd"), py::arg("buckets") = std::vector<uint32_t>{})
      .def("load_state",
           [](OptimizerHandle& h, int fd) {
             py::gil_scoped_release release;
             return Value(h.opt->LoadState(fd));
           })
      .def(
          "retire_buckets",
          [](OptimizerHandle& h, const std::vector<uint32_t>& buckets) {
            tsd::Optimizer::Retired r;
            {
              py::gil_scoped_release release;
              r = Value(h.opt->RetireBuckets(buckets));
            }
            return py::make_tuple(r.released_bytes, r.retired);
          },
          py::arg("buckets"));
}
