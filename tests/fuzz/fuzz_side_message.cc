// Fuzzes the side socket's message decoder (proto/side_message.h) as both ends use it: the input
// is cut into datagrams (frames.h: each prefixed by a 2-byte length), fed to a SideAssembler of
// requests (the daemon's side) and one of replies (the client's side), and every message that does
// not parse is explained by ExplainParseFailure. Nothing may crash, leak or read out of bounds, and
// a message that is refused must be explained by a non-empty text.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "frames.h"
#include "proto/side_message.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"

namespace {

template <typename M>
void FeedAll(const uint8_t* data, size_t size, size_t max_bytes) {
  tsd::wire::SideAssembler<M> assembler(max_bytes);
  tsd::fuzz::ForEachFrame(data, size, [&](std::string_view frame) {
    tsd::wire::Datagram d;
    d.bytes.assign(frame);
    uint64_t id = 0;
    auto whole = assembler.Feed(std::move(d), &id);
    if (!whole.ok() && whole.status().message().empty()) std::abort();  // refusals say why
    if (whole.ok() && *whole) {
      // A whole message re-serialises (the daemon echoes parts of it back).
      std::string again;
      if (!assembler.message().SerializeToString(&again)) std::abort();
    }
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Small limits, so that the fuzzer reaches the size checks.
  FeedAll<tsd::v1::SideRequest>(data, size, 1 << 16);
  FeedAll<tsd::v1::SideReply>(data, size, 1 << 16);
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  tsd::v1::SideRequest request;
  if (!request.ParseFromString(bytes) &&
      tsd::wire::ExplainParseFailure(bytes, "tsd.v1.SideRequest").empty()) {
    std::abort();
  }
  return 0;
}
