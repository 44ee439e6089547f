#include "daemon/memory/numa_topology.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace tsd {
namespace {

constexpr size_t kMaxFileBytes = 64 * 1024;  // a cpulist of 8192 CPUs fits many times over

// The whole of a small sysfs file; NOT_FOUND when it is missing, DATA_LOSS when oversized.
absl::StatusOr<std::string> ReadSmallFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read ", path.string(), ": ",
                                            std::strerror(errno != 0 ? errno : ENOENT)));
  }
  std::string text(kMaxFileBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxFileBytes) {
    return absl::DataLossError(
        absl::StrCat(path.string(), " is larger than ", kMaxFileBytes, " bytes"));
  }
  return text;
}

bool IsHex(absl::string_view s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](char c) { return absl::ascii_isxdigit(c); });
}

}  // namespace

absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view text, int max_id) {
  const absl::string_view body = absl::StripAsciiWhitespace(text);
  std::vector<int> cpus;
  if (body.empty()) return cpus;
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CPU list '", body.substr(0, 80), "' is not a list of CPU ids and ranges (", why, ")"));
  };
  for (absl::string_view part : absl::StrSplit(body, ',')) {
    std::pair<absl::string_view, absl::string_view> ends =
        absl::StrSplit(part, absl::MaxSplits('-', 1));
    const bool range = part.find('-') != absl::string_view::npos;
    int lo = 0, hi = 0;
    if (ends.first.empty() ||
        !std::all_of(ends.first.begin(), ends.first.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(ends.first, &lo)) {
      return bad("a part is not a number");
    }
    hi = lo;
    if (range && (ends.second.empty() ||
                  !std::all_of(ends.second.begin(), ends.second.end(), absl::ascii_isdigit) ||
                  !absl::SimpleAtoi(ends.second, &hi))) {
      return bad("a range's end is not a number");
    }
    if (hi < lo) return bad("a range ends before it starts");
    if (hi >= max_id) return bad(absl::StrCat("an id is ", max_id, " or more"));
    for (int c = lo; c <= hi; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

absl::StatusOr<std::string> CanonicalPciBusId(absl::string_view bus_id) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("PCI bus id '", absl::CEscape(bus_id.substr(0, 64)),
                     "' is not a PCI address; send it as DOMAIN:BUS:DEVICE.FUNCTION in hex, e.g. "
                     "0000:c1:00.0 (or none, for a trainer without a GPU)"));
  };
  if (bus_id.size() > 32) return bad();
  std::vector<absl::string_view> parts = absl::StrSplit(bus_id, ':');
  if (parts.size() != 3) return bad();
  std::pair<absl::string_view, absl::string_view> dev_fn =
      absl::StrSplit(parts[2], absl::MaxSplits('.', 1));
  if (parts[2].find('.') == absl::string_view::npos) return bad();
  const absl::string_view domain = parts[0], bus = parts[1], device = dev_fn.first,
                          function = dev_fn.second;
  if (!IsHex(domain) || domain.size() > 8 || !IsHex(bus) || bus.size() != 2 || !IsHex(device) ||
      device.size() != 2 || function.size() != 1 || function[0] < '0' || function[0] > '7') {
    return bad();
  }
  uint32_t d = 0, b = 0, v = 0;
  if (!absl::SimpleHexAtoi(domain, &d) || !absl::SimpleHexAtoi(bus, &b) ||
      !absl::SimpleHexAtoi(device, &v) || v > 0x1f) {
    return bad();
  }
  char out[32];
  std::snprintf(out, sizeof(out), "%04x:%02x:%02x.%c", d, b, v, function[0]);
  return std::string(out);
}

absl::StatusOr<NumaTopology> NumaTopology::Load(const std::string& sysfs_root) {
  const std::filesystem::path dir = std::filesystem::path(sysfs_root) / "devices/system/node";
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("no NUMA nodes listed at ", dir.string(), ": ", ec.message()));
  }
  std::vector<NumaNode> nodes;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    absl::string_view digits = name;
    if (!absl::ConsumePrefix(&digits, "node") || digits.empty() ||
        !std::all_of(digits.begin(), digits.end(), absl::ascii_isdigit)) {
      continue;  // has_cpu, online, possible, power, ...
    }
    NumaNode node;
    if (!absl::SimpleAtoi(digits, &node.id) || node.id >= kMaxNodes) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry.path().string(), ": node id beyond ", kMaxNodes));
    }
    auto text = ReadSmallFile(entry.path() / "cpulist");
    if (!text.ok()) return text.status();
    auto cpus = ParseCpuList(*text, kMaxCpus);
    if (!cpus.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat((entry.path() / "cpulist").string(), ": ", cpus.status().message()));
    }
    node.cpus = *std::move(cpus);
    nodes.push_back(std::move(node));
    if (nodes.size() > static_cast<size_t>(kMaxNodes)) {
      return absl::InvalidArgumentError(absl::StrCat(dir.string(), " lists too many nodes"));
    }
  }
  if (nodes.empty()) {
    return absl::NotFoundError(absl::StrCat("no node<N> directory under ", dir.string()));
  }
  return FromNodes(sysfs_root, std::move(nodes));
}

NumaTopology NumaTopology::FromNodes(std::string sysfs_root, std::vector<NumaNode> nodes) {
  NumaTopology t;
  t.root_ = std::move(sysfs_root);
  std::sort(nodes.begin(), nodes.end(),
            [](const NumaNode& a, const NumaNode& b) { return a.id < b.id; });
  t.nodes_ = std::move(nodes);
  return t;
}

const NumaNode* NumaTopology::FindNode(int id) const {
  for (const NumaNode& n : nodes_) {
    if (n.id == id) return &n;
  }
  return nullptr;
}

absl::StatusOr<NumaPlacement> NumaTopology::PlaceDevice(absl::string_view bus_id) const {
  NumaPlacement out;
  if (bus_id.empty()) return out;  // no GPU: nothing to be near
  auto canonical = CanonicalPciBusId(bus_id);
  if (!canonical.ok()) return canonical.status();
  const std::filesystem::path file =
      std::filesystem::path(root_) / "bus/pci/devices" / *canonical / "numa_node";
  auto text = ReadSmallFile(file);
  if (!text.ok()) {
    out.reason = absl::StrCat("PCI device ", *canonical, ": ", text.status().message());
    return out;
  }
  const absl::string_view value = absl::StripAsciiWhitespace(*text);
  int node = -1;
  if (!absl::SimpleAtoi(value, &node)) {
    out.reason = absl::StrCat(file.string(), " holds '", absl::CEscape(value.substr(0, 32)),
                              "', not a node number");
    return out;
  }
  if (node < 0) {
    out.reason = absl::StrCat("the kernel reports no NUMA node for PCI device ", *canonical,
                              " (numa_node ", node, ")");
    return out;
  }
  if (FindNode(node) == nullptr) {
    out.reason = absl::StrCat("PCI device ", *canonical, " is on node ", node,
                              ", which is not among this host's nodes (", Describe(), ")");
    return out;
  }
  out.node = node;
  return out;
}

std::string NumaTopology::Describe() const {
  return absl::StrJoin(nodes_, " ", [](std::string* out, const NumaNode& n) {
    // Compress the ascending CPU ids back into ranges.
    std::vector<std::string> ranges;
    for (size_t i = 0; i < n.cpus.size();) {
      size_t j = i;
      while (j + 1 < n.cpus.size() && n.cpus[j + 1] == n.cpus[j] + 1) ++j;
      ranges.push_back(i == j ? absl::StrCat(n.cpus[i]) : absl::StrCat(n.cpus[i], "-", n.cpus[j]));
      i = j + 1;
    }
    absl::StrAppend(out, n.id, ":", ranges.empty() ? "none" : absl::StrJoin(ranges, ","));
  });
}

}  // namespace tsd
