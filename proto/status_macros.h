// The one RETURN_IF_ERROR / ASSIGN_OR_RETURN pair for absl::Status in tsd and its C++ client.
//
//   TSD_RETURN_IF_ERROR(DoThing());                 // returns the status when it is not OK
//   TSD_ASSIGN_OR_RETURN(auto region, Alloc(...));  // declares/assigns from a StatusOr, or returns
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define TSD_STATUS_CONCAT_INNER_(a, b) a##b
#define TSD_STATUS_CONCAT_(a, b) TSD_STATUS_CONCAT_INNER_(a, b)

#define TSD_RETURN_IF_ERROR(expr)                                 \
  do {                                                            \
    if (::absl::Status tsd_status_ = (expr); !tsd_status_.ok()) { \
      return tsd_status_;                                         \
    }                                                             \
  } while (false)

#define TSD_ASSIGN_OR_RETURN(lhs, expr) \
  TSD_ASSIGN_OR_RETURN_IMPL_(TSD_STATUS_CONCAT_(tsd_statusor_, __LINE__), lhs, expr)

#define TSD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)    \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()
