// SideHandler turns one side-socket request of a connection into its reply. It is the session
// half of the protocol (proto/tsd.proto): `SideAttach` binds a connection to a new session of a
// job for the uid the kernel reported; every later request acts for that session and no other.
// It checks what the Registry does not (the protocol version, which requests may carry a
// descriptor, what kind of file a state descriptor is) and maps each request to the Registry or
// the job's optimizer. Its only state is the two log budgets (thread-safe), so the side server's
// workers share one.
// Two requests need no session: `checkpoint` and `list_stores` (the stores the caller's uid
// proved read access to; every store for tsd's own uid).
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdint>

#include "absl/types/span.h"
#include "daemon/jobs/registry.h"
#include "daemon/ops/log_budget.h"
#include "daemon/optimizer/registrar.h"
#include "daemon/stores/store_manager.h"
#include "proto/tsd.pb.h"

namespace tsd {

// Who sent a request: the kernel's word for the connection (SO_PEERCRED) and the session the
// connection belongs to (0 before its attach).
struct SideCaller {
  uid_t uid = 0;
  pid_t pid = 0;
  uint64_t session_id = 0;
};

// What to do after a request.
struct SideOutcome {
  v1::SideReply reply;
  int fd = -1;                 // a descriptor to send with the reply; the receiver of this owns it
  uint64_t bound_session = 0;  // non-zero: the connection belongs to this session from now on
  bool close = false;          // close the connection once the reply is sent
  const char* close_reason = "";
};

class SideHandler final {
 public:
  // `stores` may be null: store requests are then refused (UNIMPLEMENTED), and list_stores
  // lists none.
  explicit SideHandler(Registry& registry, stores::StoreManager* stores = nullptr)
      : registry_(registry), registrar_(registry), stores_(stores) {}

  // Serves `request` for `caller`; `fd` (or -1) is a descriptor that came with it, which this
  // takes (it is closed unless the request is a state request that uses it).
  SideOutcome Handle(const SideCaller& caller, const v1::SideRequest& request, int fd);

 private:
  SideOutcome Attach(const SideCaller& caller, const v1::SideAttach& attach);
  // Save or load the job's optimizer state through `fd`, a file the trainer opened.
  // save_state (`buckets`: only these, empty: all) or load_state with the datagram's `fd`.
  absl::StatusOr<uint64_t> State(uint64_t session_id, bool save, int fd,
                                 absl::Span<const uint32_t> buckets = {});
  // tsctl checkpoint: writes `job`'s optimizer state into `fd` for its owner (side_handler.cc).
  absl::StatusOr<uint64_t> Checkpoint(const SideCaller& caller, const std::string& job, int fd);
  // store_file, open_store and close_store (side_handler_stores.cc); takes `fd`.
  absl::Status Store(const SideCaller& caller, const v1::SideRequest& request, int fd,
                     SideOutcome& out);
  // list_stores (side_handler_stores.cc): what `caller`'s uid may see, and the node's totals.
  void ListStores(const SideCaller& caller, v1::ListStoresResponse& reply) const;

  Registry& registry_;
  Registrar registrar_;
  stores::StoreManager* const stores_;
  const uid_t daemon_uid_ = geteuid();  // sees every store
  // Refused attaches and descriptors sent with requests that take none cost a client nothing to
  // repeat (a reconnect, a resend): their log lines are bounded per uid, like bad messages'.
  LogBudget attach_refused_log_{20, absl::Seconds(10)};
  LogBudget unexpected_fd_log_{20, absl::Seconds(10)};
};

}  // namespace tsd
