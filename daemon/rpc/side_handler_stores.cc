// The store requests of the side socket (proto/tsd.proto, "Weight stores"): SideHandler's half
// that maps them to the StoreManager, and list_stores. The client's list of tensors is copied
// into a StoreSpec unchecked here: the StoreManager and the builder check every name, size, dtype
// and shape.
#include <unistd.h>

#include <optional>

#include "absl/strings/str_cat.h"
#include "daemon/rpc/side_handler.h"
#include "proto/status_macros.h"
#include "proto/wire.h"

namespace tsd {
namespace {

void Fill(v1::StoreInfo& info, const stores::StoreStatus& s) {
  info.set_store_id(s.id);
  info.set_source(s.source);
  info.set_format(s.format);
  info.set_block_size(s.block_size);
  info.set_size_bytes(s.bytes);
  info.set_users(s.users);
  info.set_idle_s(s.idle_s);
  info.set_digest(s.digest);
  info.set_tensors(s.tensors);
  info.set_locked(s.locked);
  for (const stores::DeviceCopyStatus& d : s.device_copies) {
    v1::DeviceCopyInfo* c = info.add_device_copies();
    c->set_gpu_uuid(d.gpu_uuid);
    c->set_size_bytes(d.bytes);
    c->set_users(d.users);
    c->set_idle_s(d.idle_s);
  }
}

}  // namespace

absl::Status SideHandler::Store(const SideCaller& caller, const v1::SideRequest& request, int fd,
                                SideOutcome& out) {
  const uint64_t session_id = caller.session_id;
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
  } closer{fd};
  if (stores_ == nullptr) {
    return absl::UnimplementedError("this daemon serves no weight stores");
  }
  TSD_ASSIGN_OR_RETURN(const JobRef job, registry_.SessionJob(session_id));
  const stores::StoreUser user{job.name, job.instance};
  if (request.has_store_file()) {
    return stores_->StageFile(session_id, user, std::exchange(closer.fd, -1));
  }
  if (request.has_open_device_store()) {
    const v1::SideOpenDeviceStore& want = request.open_device_store();
    TSD_ASSIGN_OR_RETURN(
        stores::OpenedDeviceCopy copy,
        stores_->OpenDeviceCopy(user, want.store_id(), want.gpu_uuid().substr(0, 128)));
    auto* reply = out.reply.mutable_open_device_store();
    reply->set_store_id(want.store_id());
    reply->set_gpu_uuid(copy.gpu_uuid);
    reply->set_size_bytes(copy.size);
    reply->set_data_bytes(copy.data_bytes);
    reply->set_kind(v1::CUDA_VMM_FD);
    out.fd = copy.fd;
    return absl::OkStatus();
  }
  if (request.has_close_store()) {
    TSD_RETURN_IF_ERROR(stores_->Close(user, request.close_store().store_id()));
    out.reply.mutable_close_store();
    return absl::OkStatus();
  }
  const v1::SideOpenStore& open = request.open_store();
  stores::StoreSpec spec;
  TSD_ASSIGN_OR_RETURN(spec.format, stores::ParseStoreFormat(open.format()));
  spec.block_size = open.block_size() == 0 ? 64 : open.block_size();
  spec.tensors.reserve(static_cast<size_t>(open.tensors_size()));
  for (const v1::StoreTensorSpec& t : open.tensors()) {
    spec.tensors.push_back({t.name(), t.quantize()});
  }
  TSD_ASSIGN_OR_RETURN(stores::OpenedStore opened,
                       stores_->Open(session_id, user, spec, caller.uid));
  auto* reply = out.reply.mutable_open_store();
  Fill(*reply->mutable_store(), opened.status);
  reply->set_built(opened.built);
  for (const stores::StoredTensor& t : opened.tensors) {
    v1::StoreTensor* w = reply->add_tensors();
    w->set_name(t.name);
    w->set_dtype(t.dtype);
    for (uint64_t d : t.shape) w->add_shape(d);
    w->set_quantized(t.quantized);
    w->set_offset(t.offset);
    w->set_bytes(t.bytes);
    w->set_absmax_offset(t.absmax_offset);
    w->set_absmax_count(t.absmax_count);
  }
  out.fd = opened.fd;
  return absl::OkStatus();
}

void SideHandler::ListStores(const SideCaller& caller, v1::ListStoresResponse& reply) const {
  if (stores_ == nullptr) return;  // no stores: nothing to see, totals 0
  const stores::StoreListing listing =
      stores_->ListFor(caller.uid == daemon_uid_ ? std::nullopt : std::optional<uid_t>(caller.uid));
  reply.set_store_count(listing.node_stores);
  reply.set_used_bytes(listing.node_bytes);
  reply.set_budget_bytes(listing.budget_bytes);
  // A store's source list can be long (up to max_staged_files paths): stop short of the side
  // socket's message limit and say how many were left out.
  size_t bytes = reply.ByteSizeLong();
  constexpr size_t kRoom = wire::kMaxSideMessageBytes - 64 * 1024;
  for (const stores::StoreStatus& s : listing.stores) {
    v1::StoreInfo info;
    Fill(info, s);
    const size_t more = info.ByteSizeLong() + 8;  // the field's tag and length
    if (bytes + more > kRoom) {
      reply.set_omitted(reply.omitted() + 1);
      continue;
    }
    bytes += more;
    *reply.add_stores() = std::move(info);
  }
}

}  // namespace tsd
