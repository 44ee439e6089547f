// Side messages over side datagrams: the framing both ends of the side socket share.
//
// A side message (a tsd.v1.SideRequest or SideReply) normally fits one datagram. One that does
// not (a registration of many buckets, a long region list) travels as a run of datagrams that
// carry only the request id, a `fragment` of the serialized message and `more_fragments`. The
// sender splits with SendSideMessage; the receiver feeds every datagram it reads into a
// SideAssembler, which puts fragments together, bounds the total size, and explains a message
// that does not parse (where and why), so an error reply can say what was wrong.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"

namespace tsd::wire {

// Sends `msg` as one datagram, or as fragments when it is larger than kMaxSideDatagramBytes;
// `fd` (when >= 0) travels with the first datagram. Waits up to `timeout_ms` for room in the
// peer's queue (0: never waits).
absl::Status SendSideMessage(int sock, const v1::SideRequest& msg, int fd, int timeout_ms);
absl::Status SendSideMessage(int sock, const v1::SideReply& msg, int fd, int timeout_ms);

// Says why `bytes` is not a valid serialized message of `type_name` ("tsd.v1.SideRequest"):
// the byte offset and what is wrong there (a truncated varint, a length past the end, a field
// of the wrong wire type, a nested message that does not parse, ...).
std::string ExplainParseFailure(const std::string& bytes, const std::string& type_name);

// Puts side messages of type M (SideRequest or SideReply) together from datagrams, for one
// connection. Not thread-safe: one reader per connection.
template <typename M>
class SideAssembler {
 public:
  // `max_bytes`: the largest message put together from fragments.
  explicit SideAssembler(size_t max_bytes = kMaxSideMessageBytes) : max_bytes_(max_bytes) {}
  ~SideAssembler() { Reset(); }
  SideAssembler(const SideAssembler&) = delete;
  SideAssembler& operator=(const SideAssembler&) = delete;

  // Feeds one datagram (taking its descriptor). Returns true when a whole message is ready in
  // `message()` (its descriptor in `TakeFd()`), false when more fragments are expected, or
  // INVALID_ARGUMENT saying what was wrong; after an error the assembler starts over.
  // `*request_id` gets the id of the message being assembled when it could be read (else 0).
  absl::StatusOr<bool> Feed(Datagram datagram, uint64_t* request_id);
  M& message() { return message_; }
  // The descriptor that came with the message (or -1); the caller owns it.
  int TakeFd() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Drops a half-assembled message and its descriptor.
  void Reset();
  // Bytes of a half-assembled message held now.
  size_t pending_bytes() const { return partial_.size(); }

 private:
  const size_t max_bytes_;
  M message_;
  std::string partial_;
  uint64_t partial_id_ = 0;
  bool in_fragments_ = false;
  int fd_ = -1;
};

extern template class SideAssembler<v1::SideRequest>;
extern template class SideAssembler<v1::SideReply>;

}  // namespace tsd::wire
