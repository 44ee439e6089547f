// Client's weight-store calls: opening a store from checkpoint files (tsd builds it from the
// descriptors), mapping it read-only, its device copies, closing and listing stores.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "client_impl.h"
#include "tsd/client.h"
#include "tsd/device_store.h"
#include "tsd/store.h"

namespace tsd {

using client_detail::kMinStateTimeout;
namespace {

StoreStatus FromInfo(const v1::StoreInfo& i) {
  StoreStatus s{i.store_id(), i.source(), i.format(), i.block_size(), i.size_bytes(),
                i.users(),    i.idle_s(), i.digest(), i.tensors(),    i.locked()};
  for (const v1::DeviceCopyInfo& d : i.device_copies()) {
    s.device_copies.push_back({d.gpu_uuid(), d.size_bytes(), d.users(), d.idle_s()});
  }
  return s;
}

}  // namespace

StoreView::~StoreView() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), status_.bytes);
  if (fd_ >= 0) close(fd_);
}

const StoreTensorView* StoreView::Find(const std::string& name) const {
  for (const StoreTensorView& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<StoreView>> Client::OpenStore(const std::vector<std::string>& files,
                                                             const StoreSpec& spec) {
  std::vector<int> fds;
  struct Closer {
    std::vector<int>& fds;
    ~Closer() {
      for (int fd : fds) close(fd);
    }
  } closer{fds};
  for (const std::string& path : files) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("cannot open checkpoint file ", path, ": ", std::strerror(errno)));
    }
    fds.push_back(fd);
  }
  return OpenStoreFds(fds, spec);
}

absl::StatusOr<std::shared_ptr<StoreView>> Client::OpenStoreFds(const std::vector<int>& fds,
                                                                const StoreSpec& spec) {
  std::shared_ptr<StoreView> view(new StoreView());
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    // The files, one request each (a side message carries one descriptor), then the open: all
    // under the client's lock, so no other request of this session comes between them.
    for (int fd : fds) {
      v1::SideRequest req;
      req.mutable_store_file();
      TSD_ASSIGN_OR_RETURN(auto reply,
                           impl_->Call(std::move(req), fd, impl_->request_timeout, "store_file"));
      if (reply.second >= 0) close(reply.second);
    }
    v1::SideRequest req;
    auto* open = req.mutable_open_store();
    open->set_format(spec.format);
    open->set_block_size(spec.block_size);
    for (const StoreSpec::Tensor& t : spec.tensors) {
      auto* w = open->add_tensors();
      w->set_name(t.name);
      w->set_quantize(t.quantize);
    }
    // Building a large store takes a while: wait as long as for optimizer state.
    TSD_ASSIGN_OR_RETURN(
        auto reply, impl_->Call(std::move(req), -1,
                                std::max(impl_->request_timeout, kMinStateTimeout), "open_store"));
    view->fd_ = reply.second;
    if (view->fd_ < 0) return absl::InternalError("tsd's open_store reply carried no descriptor");
    const v1::SideOpenStoreReply& r = reply.first.open_store();
    view->status_ = FromInfo(r.store());
    view->built_ = r.built();
    for (const v1::StoreTensor& t : r.tensors()) {
      view->tensors_.push_back(StoreTensorView{
          t.name(), t.dtype(), std::vector<uint64_t>(t.shape().begin(), t.shape().end()),
          t.quantized(), t.offset(), t.bytes(), t.absmax_offset(), t.absmax_count()});
    }
  }
  // The daemon is not trusted either: the table must lie inside the store.
  const uint64_t size = view->status_.bytes;
  for (const StoreTensorView& t : view->tensors_) {
    const bool inside = t.offset <= size && t.bytes <= size - t.offset &&
                        (!t.quantized || (t.absmax_offset <= size &&
                                          t.absmax_count <= (size - t.absmax_offset) / 4));
    if (!inside) {
      return absl::InternalError(absl::StrCat("tsd's table puts tensor '", t.name,
                                              "' outside the store's ", size, " bytes"));
    }
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, view->fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping store ", view->id(), " (", size,
                                                     " bytes) failed: ", std::strerror(errno)));
  }
  view->data_ = static_cast<const uint8_t*>(p);
  return view;
}

absl::Status Client::CloseStore(uint64_t store_id) {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  req.mutable_close_store()->set_store_id(store_id);
  return impl_->CallNoFd(std::move(req), "close_store").status();
}

absl::StatusOr<std::shared_ptr<DeviceStoreView>> Client::OpenDeviceStore(
    uint64_t store_id, const std::string& gpu_uuid) {
  // This process must be able to map it before tsd is asked to make it.
  TSD_RETURN_IF_ERROR(GpuOrdinal(gpu_uuid).status());
  std::pair<v1::SideReply, int> reply;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest req;
    req.mutable_open_device_store()->set_store_id(store_id);
    req.mutable_open_device_store()->set_gpu_uuid(gpu_uuid);
    // The first job on a GPU waits while tsd copies the store there.
    TSD_ASSIGN_OR_RETURN(
        reply, impl_->Call(std::move(req), -1, std::max(impl_->request_timeout, kMinStateTimeout),
                           "open_device_store"));
  }
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
  } closer{reply.second};
  if (closer.fd < 0)
    return absl::InternalError("tsd's open_device_store reply carried no descriptor");
  const v1::SideOpenDeviceStoreReply& r = reply.first.open_device_store();
  return DeviceStoreView::Map(store_id, r.gpu_uuid(), closer.fd, r.size_bytes(), r.data_bytes());
}

absl::StatusOr<StoreListing> Client::ListStores() {
  // On the side socket, where tsd learns this process's uid: the gRPC ListStores cannot tell who
  // calls and gives the node's totals only.
  std::pair<v1::SideReply, int> reply;
  {
    MutexLock lock(impl_->mu);
    v1::SideRequest req;
    req.mutable_list_stores();
    if (impl_->attached) {
      TSD_ASSIGN_OR_RETURN(reply,
                           impl_->Call(std::move(req), -1, impl_->request_timeout, "list_stores"));
    } else {
      TSD_ASSIGN_OR_RETURN(
          reply, impl_->CallAlone(std::move(req), -1, impl_->request_timeout, "list_stores"));
    }
  }
  if (reply.second >= 0) close(reply.second);
  const v1::ListStoresResponse& r = reply.first.list_stores();
  StoreListing out;
  for (const v1::StoreInfo& i : r.stores()) out.stores.push_back(FromInfo(i));
  out.node_stores = r.store_count();
  out.node_bytes = r.used_bytes();
  out.budget_bytes = r.budget_bytes();
  out.omitted = r.omitted();
  return out;
}

absl::StatusOr<std::vector<StoreStatus>> Client::Stores() {
  TSD_ASSIGN_OR_RETURN(StoreListing listing, ListStores());
  return std::move(listing.stores);
}

}  // namespace tsd
