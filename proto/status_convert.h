// Maps absl::Status to grpc::Status and back. gRPC's and absl's codes share their numbering, so
// the mapping keeps the code and the message.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace tsd::wire {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace tsd::wire
