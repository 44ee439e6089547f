#include "daemon/rpc/side_handler.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/ops/version.h"
#include "proto/status_macros.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

void SetError(v1::SideReply& reply, const absl::Status& status) {
  reply.set_code(static_cast<int>(status.code()));
  reply.set_message(std::string(status.message()));
}

const char* KindName(const v1::SideRequest& r) {
  switch (r.kind_case()) {
    case v1::SideRequest::kAttach:
      return "attach";
    case v1::SideRequest::kGetFd:
      return "get_fd";
    case v1::SideRequest::kSaveState:
      return "save_state";
    case v1::SideRequest::kLoadState:
      return "load_state";
    case v1::SideRequest::kAlloc:
      return "alloc";
    case v1::SideRequest::kFree:
      return "free";
    case v1::SideRequest::kListRegions:
      return "list_regions";
    case v1::SideRequest::kDetach:
      return "detach";
    case v1::SideRequest::kRegisterOptimizer:
      return "register_optimizer";
    case v1::SideRequest::kStoreFile:
      return "store_file";
    case v1::SideRequest::kOpenStore:
      return "open_store";
    case v1::SideRequest::kCloseStore:
      return "close_store";
    case v1::SideRequest::kOpenDeviceStore:
      return "open_device_store";
    case v1::SideRequest::kCheckpoint:
      return "checkpoint";
    case v1::SideRequest::kListStores:
      return "list_stores";
    case v1::SideRequest::kRetireBuckets:
      return "retire_buckets";
    case v1::SideRequest::KIND_NOT_SET:
      break;
  }
  return "none";
}

// Refuses a state descriptor that is not a regular file (or memfd) open the way the request
// needs it, before the optimizer touches it.
absl::Status CheckStateFd(int fd, bool save) {
  if (fd < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a ", save ? "save" : "load",
        "_state request must carry the state file's descriptor (SCM_RIGHTS); none came with it"));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the state descriptor cannot be examined: ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    const char* what = S_ISFIFO(st.st_mode)   ? "a pipe"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                                              : "not a regular file";
    return absl::InvalidArgumentError(absl::StrCat(
        "the state descriptor is ", what,
        "; pass a regular file or a memfd (open the file yourself and send its descriptor)"));
  }
  const int flags = fcntl(fd, F_GETFL);
  const int mode = flags & O_ACCMODE;
  if (save && mode == O_RDONLY) {
    return absl::InvalidArgumentError(
        "the state descriptor is open read-only; open the file for writing to save into it");
  }
  if (!save && mode == O_WRONLY) {
    return absl::InvalidArgumentError(
        "the state descriptor is open write-only; open the file for reading to load from it");
  }
  return absl::OkStatus();
}

}  // namespace

SideOutcome SideHandler::Handle(const SideCaller& caller, const v1::SideRequest& request, int fd) {
  SideOutcome out;
  out.reply.set_request_id(request.request_id());
  const bool wants_fd = request.has_save_state() || request.has_load_state() ||
                        request.has_store_file() || request.has_checkpoint();
  if (fd >= 0 && !wants_fd) {
    // Only state and store_file requests carry a descriptor: any other is closed unread, so no
    // client can make the daemon hold descriptors.
    close(fd);
    fd = -1;
    unexpected_fd_log_.Warn(
        caller.uid, "event=unexpected_fd uid={} pid={} session={} request={} earlier_not_logged={}",
        caller.uid, caller.pid, caller.session_id, KindName(request));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() {
      if (fd >= 0) close(fd);
    }
  } closer{fd};
  if (request.request_id() == 0) {
    SetError(out.reply, absl::InvalidArgumentError(
                            "side request has request_id 0; number requests from 1 (0 marks the "
                            "daemon's notices)"));
    out.close = caller.session_id == 0;
    out.close_reason = "no_request_id";
    return out;
  }
  if (request.kind_case() == v1::SideRequest::KIND_NOT_SET) {
    SetError(out.reply, absl::InvalidArgumentError(absl::StrCat(
                            "side request ", request.request_id(),
                            " names no request (attach, alloc, free, list_regions, get_fd, "
                            "detach, register_optimizer, save_state, load_state, "
                            "retire_buckets, store_file, open_store, close_store, "
                            "open_device_store, list_stores or checkpoint)")));
    out.close = caller.session_id == 0;
    out.close_reason = "empty_request";
    return out;
  }
  if (request.has_attach()) {
    if (caller.session_id != 0) {
      SetError(out.reply, absl::FailedPreconditionError(absl::StrCat(
                              "this connection already belongs to session ", caller.session_id,
                              "; open another connection for another session")));
      return out;
    }
    SideOutcome attached = Attach(caller, request.attach());
    attached.reply.set_request_id(request.request_id());
    return attached;
  }
  if (request.has_checkpoint()) {
    // A connection's only request, with no session (tsctl checkpoint): it closes afterwards.
    auto written = caller.session_id != 0
                       ? absl::StatusOr<uint64_t>(absl::FailedPreconditionError(
                             "checkpoint is a request of its own connection, not of a session"))
                       : Checkpoint(caller, request.checkpoint().job(), fd);
    if (!written.ok()) {
      SetError(out.reply, written.status());
    } else {
      out.reply.mutable_state()->set_bytes(*written);
    }
    out.close = caller.session_id == 0;
    out.close_reason = "checkpoint_done";
    return out;
  }
  if (request.has_list_stores()) {
    // Needs no session (tsctl stores): the stores the caller's uid proved read access to. Without
    // a session it is the connection's only request, as checkpoint is: it closes afterwards.
    ListStores(caller, *out.reply.mutable_list_stores());
    out.close = caller.session_id == 0;
    out.close_reason = "list_stores_done";
    return out;
  }
  if (caller.session_id == 0) {
    SetError(out.reply, absl::FailedPreconditionError(absl::StrCat(
                            "a ", KindName(request),
                            " request before SideAttach: this connection has no session; "
                            "attach first")));
    out.close = true;
    out.close_reason = "request_before_attach";
    return out;
  }
  const uint64_t sid = caller.session_id;
  switch (request.kind_case()) {
    case v1::SideRequest::kAlloc: {
      auto info = registry_.Alloc(sid, request.alloc().name(), request.alloc().size_bytes());
      if (!info.ok()) {
        SetError(out.reply, info.status());
      } else {
        *out.reply.mutable_alloc()->mutable_region() = std::move(*info);
      }
      break;
    }
    case v1::SideRequest::kFree: {
      auto freed = registry_.Free(sid, request.free().region_id());
      if (!freed.ok()) {
        SetError(out.reply, freed.status());
      } else {
        out.reply.mutable_free()->set_freed_bytes(*freed);
      }
      break;
    }
    case v1::SideRequest::kListRegions: {
      auto regions = registry_.ListRegions(sid);
      if (!regions.ok()) {
        SetError(out.reply, regions.status());
      } else {
        for (auto& r : *regions) *out.reply.mutable_list_regions()->add_regions() = std::move(r);
      }
      break;
    }
    case v1::SideRequest::kGetFd: {
      auto region = registry_.GetFd(sid, request.get_fd().region_id());
      if (!region.ok()) {
        SetError(out.reply, region.status());
      } else {
        *out.reply.mutable_fd()->mutable_region() = region->info;
        out.fd = region->fd;
      }
      break;
    }
    case v1::SideRequest::kRegisterOptimizer: {
      auto r = registrar_.Register(sid, request.register_optimizer());
      if (!r.ok()) {
        SetError(out.reply, r.status());
      } else {
        *out.reply.mutable_register_optimizer() = std::move(*r);
      }
      break;
    }
    case v1::SideRequest::kSaveState:
    case v1::SideRequest::kLoadState: {
      const auto& subset = request.save_state().buckets();  // empty for load_state
      auto moved = State(sid, request.has_save_state(), fd,
                         absl::MakeConstSpan(subset.data(), subset.size()));
      if (!moved.ok()) {
        SetError(out.reply, moved.status());
      } else {
        out.reply.mutable_state()->set_bytes(*moved);
      }
      break;
    }
    case v1::SideRequest::kRetireBuckets: {
      const auto& list = request.retire_buckets().buckets();
      auto retired = registry_.RetireBuckets(sid, absl::MakeConstSpan(list.data(), list.size()),
                                             request.retire_buckets().masters_unpinned());
      if (!retired.ok()) {
        SetError(out.reply, retired.status());
      } else {
        out.reply.mutable_retire()->set_released_bytes(retired->released_bytes);
        out.reply.mutable_retire()->set_retired(retired->retired);
      }
      break;
    }
    case v1::SideRequest::kStoreFile:
    case v1::SideRequest::kOpenStore:
    case v1::SideRequest::kCloseStore:
    case v1::SideRequest::kOpenDeviceStore: {
      const int taken = std::exchange(closer.fd, -1);
      if (absl::Status s = Store(caller, request, taken, out); !s.ok()) SetError(out.reply, s);
      break;
    }
    case v1::SideRequest::kDetach: {
      auto released = registry_.Detach(sid);
      if (!released.ok()) {
        SetError(out.reply, released.status());
      } else {
        out.reply.mutable_detach()->set_job_released(*released);
      }
      out.close = true;  // the session is over either way
      out.close_reason = "detach";
      break;
    }
    case v1::SideRequest::kAttach:
    case v1::SideRequest::kCheckpoint:
    case v1::SideRequest::kListStores:
    case v1::SideRequest::KIND_NOT_SET:
      break;  // handled above
  }
  return out;
}

SideOutcome SideHandler::Attach(const SideCaller& caller, const v1::SideAttach& attach) {
  SideOutcome out;
  const uint32_t theirs = attach.protocol_version();
  if (theirs != wire::kProtocolVersion) {
    const std::string upgrade =
        theirs < wire::kProtocolVersion
            ? absl::StrCat("upgrade the client (libtsclient / the trainstream package) to tsd ",
                           kVersion, "'s")
            : "upgrade tsd (or use a client built for protocol " +
                  std::to_string(wire::kProtocolVersion) + ")";
    SetError(out.reply, absl::FailedPreconditionError(absl::StrCat(
                            "client speaks protocol ", theirs, ", tsd ", kVersion,
                            " speaks protocol ", wire::kProtocolVersion, ": ", upgrade)));
    attach_refused_log_.Warn(caller.uid,
                             "event=attach_refused reason=protocol_version uid={} pid={} client={} "
                             "client_version=\"{}\" earlier_not_logged={}",
                             caller.uid, caller.pid, theirs, attach.client_version());
    out.close = true;
    out.close_reason = "protocol_version";
    return out;
  }
  AttachOptions extra;
  // Capped before the conversion so no client value overflows; the registry refuses it above
  // max_keep_for, saying the limit.
  extra.keep_for = absl::Milliseconds(
      static_cast<int64_t>(std::min<uint64_t>(attach.keep_for_ms(), uint64_t{1} << 50)));
  extra.resume = attach.resume();
  auto result = registry_.Attach(attach.job(), attach.quota_bytes(), caller.uid, caller.pid, extra);
  if (!result.ok()) {
    attach_refused_log_.Warn(
        caller.uid, "event=attach_refused uid={} pid={} error=\"{}\" earlier_not_logged={}",
        caller.uid, caller.pid, std::string(result.status().message()));
    SetError(out.reply, result.status());
    out.close = true;
    out.close_reason = "attach_refused";
    return out;
  }
  auto* reply = out.reply.mutable_attach();
  reply->set_session_id(result->session_id);
  reply->set_job(result->job);
  reply->set_uid(caller.uid);
  reply->set_quota_bytes(result->quota_bytes);
  reply->set_job_created(result->job_created);
  reply->set_protocol_version(wire::kProtocolVersion);
  reply->set_daemon_version(kVersion);
  reply->set_keep_for_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(result->keep_for)));
  reply->set_resumed(result->resumed);
  reply->set_orphaned_s(absl::ToDoubleSeconds(result->orphaned_for));
  out.bound_session = result->session_id;
  return out;
}

absl::StatusOr<uint64_t> SideHandler::State(uint64_t session_id, bool save, int fd,
                                            absl::Span<const uint32_t> buckets) {
  TSD_RETURN_IF_ERROR(CheckStateFd(fd, save));
  TSD_ASSIGN_OR_RETURN(std::shared_ptr<JobOptimizer> optimizer, registry_.OptimizerOf(session_id));
  return save ? optimizer->SaveState(fd, buckets) : optimizer->LoadState(fd);
}

}  // namespace tsd

namespace tsd {

absl::StatusOr<uint64_t> SideHandler::Checkpoint(const SideCaller& caller, const std::string& job,
                                                 int fd) {
  TSD_RETURN_IF_ERROR(CheckStateFd(fd, /*save=*/true));
  TSD_ASSIGN_OR_RETURN(std::shared_ptr<JobOptimizer> optimizer,
                       registry_.OptimizerForCheckpoint(job, caller.uid));
  // The GPU share's state lives in the trainer, not here: a file without it could not be loaded
  // back (load_state refuses a partial file), so refuse rather than write one that looks whole.
  // Checked again after the write, in case the trainer retired buckets meanwhile.
  auto moved = [&]() -> absl::Status {
    const size_t gone = optimizer->retired();
    if (gone == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", job, "' moved the optimizer of ", gone, " of its ",
        optimizer->plan().buckets.size(),
        " buckets into its trainer's GPU share (wrap(optimizer_gpu_fraction=...)); tsd holds no "
        "state for them, so a checkpoint from here would be partial and could not be loaded back. "
        "Save the whole state from the trainer instead (optimizer.state_dict())"));
  };
  TSD_RETURN_IF_ERROR(moved());
  // This runs on a request worker, not the side socket's thread. A job that is stepping is
  // written between two of its deliveries: wait for such a moment for a while.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (;;) {
    absl::StatusOr<uint64_t> written = optimizer->SaveState(fd);
    const bool final = written.ok() ||
                       written.status().code() != absl::StatusCode::kFailedPrecondition ||
                       absl::Now() > deadline;
    if (written.ok()) {
      if (absl::Status m = moved(); !m.ok()) written = m;  // final: retrying cannot help
    }
    if (final) {
      spdlog::info("event=checkpoint job={} uid={} pid={} bytes={} error=\"{}\"", job, caller.uid,
                   caller.pid, written.value_or(0), std::string(written.status().message()));
      return written;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace tsd
