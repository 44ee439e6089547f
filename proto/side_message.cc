#include "proto/side_message.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/descriptor.h"
#include "proto/status_macros.h"

namespace tsd::wire {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

constexpr int kMaxDepth = 32;

bool ReadVarint(const std::string& b, size_t end, size_t& pos, uint64_t* v) {
  *v = 0;
  for (int shift = 0; shift < 70 && pos < end; shift += 7) {
    const uint8_t byte = static_cast<uint8_t>(b[pos++]);
    if (shift == 63 && byte > 1) return false;  // more than 64 bits
    *v |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

bool ValidUtf8(const std::string& b, size_t begin, size_t end) {
  size_t i = begin;
  while (i < end) {
    const uint8_t c = static_cast<uint8_t>(b[i]);
    int extra = c < 0x80           ? 0
                : (c >> 5) == 0x6  ? 1
                : (c >> 4) == 0xe  ? 2
                : (c >> 3) == 0x1e ? 3
                                   : -1;
    if (extra < 0 || i + static_cast<size_t>(extra) >= end) return false;
    for (int k = 1; k <= extra; ++k) {
      if ((static_cast<uint8_t>(b[i + static_cast<size_t>(k)]) & 0xc0) != 0x80) return false;
    }
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

std::string FieldName(uint64_t number, const FieldDescriptor* f) {
  return f == nullptr ? absl::StrCat("field ", number)
                      : absl::StrCat("field ", number, " (", f->name(), ")");
}

// Walks the wire format of [begin, end) as message `d`; returns why it does not parse, or "".
std::string Walk(const std::string& b, size_t begin, size_t end, const Descriptor* d, int depth) {
  size_t pos = begin;
  while (pos < end) {
    const size_t at = pos;
    uint64_t tag = 0;
    if (!ReadVarint(b, end, pos, &tag)) {
      return absl::StrFormat("at byte %d: a field tag is cut off or longer than 10 bytes", at);
    }
    const uint64_t number = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    if (number == 0 || number > 536870911) {
      return absl::StrFormat("at byte %d: field number %d is not valid", at, number);
    }
    const FieldDescriptor* f =
        d == nullptr ? nullptr : d->FindFieldByNumber(static_cast<int>(number));
    const std::string name = FieldName(number, f);
    uint64_t value = 0;
    switch (wire_type) {
      case 0:
        if (!ReadVarint(b, end, pos, &value)) {
          return absl::StrFormat("at byte %d: the varint of %s is cut off", at, name);
        }
        break;
      case 1:
      case 5: {
        const size_t width = wire_type == 1 ? 8 : 4;
        if (end - pos < width) {
          return absl::StrFormat("at byte %d: %s needs %d bytes but only %d remain", at, name,
                                 width, end - pos);
        }
        pos += width;
        break;
      }
      case 2: {
        if (!ReadVarint(b, end, pos, &value)) {
          return absl::StrFormat("at byte %d: the length of %s is cut off", at, name);
        }
        if (value > end - pos) {
          return absl::StrFormat("at byte %d: %s says it is %d bytes long but only %d remain", at,
                                 name, value, end - pos);
        }
        const size_t inner_end = pos + static_cast<size_t>(value);
        if (f != nullptr && f->type() == FieldDescriptor::TYPE_MESSAGE) {
          if (depth >= kMaxDepth) return absl::StrFormat("at byte %d: nested too deeply", at);
          std::string why = Walk(b, pos, inner_end, f->message_type(), depth + 1);
          if (!why.empty()) {
            return absl::StrCat("in ", name, " (", f->message_type()->full_name(), "): ", why);
          }
        } else if (f != nullptr && f->type() == FieldDescriptor::TYPE_STRING &&
                   !ValidUtf8(b, pos, inner_end)) {
          return absl::StrFormat("at byte %d: %s is not valid UTF-8", at, name);
        }
        pos = inner_end;
        break;
      }
      case 3:
      case 4:
        return absl::StrFormat("at byte %d: %s uses a group (wire type %d), which tsd never sends",
                               at, name, wire_type);
      default:
        return absl::StrFormat("at byte %d: %s has wire type %d, which does not exist", at, name,
                               wire_type);
    }
  }
  return "";
}

// The request id of a datagram that does not parse, when its first field is a readable id.
uint64_t PeekRequestId(const std::string& b) {
  size_t pos = 0;
  uint64_t tag = 0, id = 0;
  if (!ReadVarint(b, b.size(), pos, &tag) || tag != ((1u << 3) | 0)) return 0;
  return ReadVarint(b, b.size(), pos, &id) ? id : 0;
}

template <typename M>
absl::Status SendImpl(int sock, const M& msg, int fd, int timeout_ms) {
  const std::string bytes = msg.SerializeAsString();
  if (bytes.size() <= kMaxSideDatagramBytes) return SendDatagram(sock, bytes, fd, timeout_ms);
  if (bytes.size() > kMaxSideMessageBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("side message of ", FormatBytes(bytes.size()),
                                                     " exceeds the limit of ",
                                                     FormatBytes(kMaxSideMessageBytes)));
  }
  constexpr size_t kChunk = kMaxSideDatagramBytes - 64;  // room for the id and the flags
  for (size_t off = 0; off < bytes.size(); off += kChunk) {
    M piece;
    piece.set_request_id(msg.request_id());
    piece.set_fragment(bytes.substr(off, kChunk));
    piece.set_more_fragments(off + kChunk < bytes.size());
    TSD_RETURN_IF_ERROR(
        SendDatagram(sock, piece.SerializeAsString(), off == 0 ? fd : -1, timeout_ms));
  }
  return absl::OkStatus();
}

}  // namespace

std::string ExplainParseFailure(const std::string& bytes, const std::string& type_name) {
  const Descriptor* d =
      google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(type_name);
  std::string why = Walk(bytes, 0, bytes.size(), d, 0);
  return why.empty() ? "the protobuf parser refused it" : why;
}

absl::Status SendSideMessage(int sock, const v1::SideRequest& msg, int fd, int timeout_ms) {
  return SendImpl(sock, msg, fd, timeout_ms);
}
absl::Status SendSideMessage(int sock, const v1::SideReply& msg, int fd, int timeout_ms) {
  return SendImpl(sock, msg, fd, timeout_ms);
}

template <typename M>
void SideAssembler<M>::Reset() {
  partial_.clear();
  partial_id_ = 0;
  in_fragments_ = false;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

template <typename M>
absl::StatusOr<bool> SideAssembler<M>::Feed(Datagram datagram, uint64_t* request_id) {
  const std::string type = M::descriptor()->full_name();
  if (!in_fragments_ && fd_ >= 0) {  // a descriptor of an earlier message nobody took
    close(fd_);
    fd_ = -1;
  }
  if (datagram.fd >= 0) {
    if (fd_ >= 0) {
      close(datagram.fd);  // one descriptor per message: the first
    } else {
      fd_ = datagram.fd;
    }
  }
  *request_id = in_fragments_ ? partial_id_ : 0;
  auto fail = [&](std::string why) {
    Reset();
    return absl::InvalidArgumentError(std::move(why));
  };
  if (datagram.truncated) {
    return fail(absl::StrCat("side datagram larger than ", FormatBytes(kMaxSideDatagramBytes),
                             "; a larger message travels as fragments (proto/side_message.h)"));
  }
  M piece;
  if (!piece.ParseFromString(datagram.bytes)) {
    if (*request_id == 0) *request_id = PeekRequestId(datagram.bytes);
    return fail(absl::StrCat("side datagram of ", datagram.bytes.size(), " bytes is not a valid ",
                             type, ": ", ExplainParseFailure(datagram.bytes, type)));
  }
  if (piece.request_id() != 0) *request_id = piece.request_id();
  const bool fragment = !piece.fragment().empty() || piece.more_fragments();
  if (!fragment) {
    if (in_fragments_) {
      return fail(absl::StrCat("a whole ", type, " arrived while fragments of request ",
                               partial_id_, " were still expected"));
    }
    message_ = std::move(piece);
    return true;
  }
  if (piece.kind_case() != M::KIND_NOT_SET) {
    return fail("a fragment may carry only request_id, fragment and more_fragments");
  }
  if (in_fragments_ && piece.request_id() != partial_id_) {
    return fail(absl::StrCat("a fragment of request ", piece.request_id(),
                             " arrived while request ", partial_id_, " was incomplete"));
  }
  if (partial_.size() + piece.fragment().size() > max_bytes_) {
    return fail(absl::StrCat("side message of request ", piece.request_id(), " exceeds ",
                             FormatBytes(max_bytes_)));
  }
  partial_ += piece.fragment();
  partial_id_ = piece.request_id();
  in_fragments_ = true;
  if (piece.more_fragments()) return false;
  const std::string whole = std::move(partial_);
  partial_.clear();
  in_fragments_ = false;
  M full;
  if (!full.ParseFromString(whole)) {
    return fail(absl::StrCat("the ", whole.size(), " bytes of request ", partial_id_,
                             "'s fragments are not a valid ", type, ": ",
                             ExplainParseFailure(whole, type)));
  }
  if (!full.fragment().empty() || full.more_fragments() || full.request_id() != partial_id_) {
    return fail(absl::StrCat("the fragments of request ", partial_id_,
                             " hold fragments again or another request id"));
  }
  message_ = std::move(full);
  return true;
}

template class SideAssembler<v1::SideRequest>;
template class SideAssembler<v1::SideReply>;

}  // namespace tsd::wire
