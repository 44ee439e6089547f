// attach_alloc: the smallest complete use of tsd from C++.
//
// It connects to tsd (at --socket, $TSD_SOCKET or the default path), attaches to a job, allocates
// a region of locked host memory, writes a pattern into it, maps the same region again through a
// second session of the job (as a second rank would) and reads the pattern back there, then shows
// the daemon's view of the pool and frees everything.
//
//   usage: attach_alloc [--socket PATH] [--mib N]
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

#include "tsd/client.h"

namespace {

int Die(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "attach_alloc: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket;
  uint64_t mib = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--socket" && i + 1 < argc) {
      socket = argv[++i];
    } else if (arg == "--mib" && i + 1 < argc) {
      mib = std::stoull(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: attach_alloc [--socket PATH] [--mib N]\n");
      return 2;
    }
  }
  auto rank0 = tsd::Client::Connect(socket);
  if (!rank0.ok()) return Die("connect", rank0.status());
  std::printf("connected to tsd at %s\n", (*rank0)->socket_path().c_str());
  if (auto s = (*rank0)->Attach("attach-alloc-example", (mib + 16) << 20); !s.ok())
    return Die("attach", s);
  std::printf("attached to job '%s' (session %llu, quota %llu MiB)\n", (*rank0)->job().c_str(),
              static_cast<unsigned long long>((*rank0)->session_id()),
              static_cast<unsigned long long>((*rank0)->quota_bytes() >> 20));

  auto region = (*rank0)->Alloc("weights", mib << 20);
  if (!region.ok()) return Die("alloc", region.status());
  auto* words = static_cast<uint64_t*>((*region)->data());
  const size_t n = (*region)->size() / sizeof(uint64_t);
  for (size_t i = 0; i < n; ++i) words[i] = i * 0x9E3779B97F4A7C15ull;
  std::printf("allocated region '%s': %llu MiB, %s, CUDA-registered: %s; wrote %zu words\n",
              (*region)->name().c_str(), static_cast<unsigned long long>((*region)->size() >> 20),
              (*region)->locked() ? "locked" : "not locked",
              (*region)->cuda_registered() ? "yes" : "no", n);

  // A second session of the same job maps the region and reads what the first one wrote.
  auto rank1 = tsd::Client::Connect(socket);
  if (!rank1.ok()) return Die("connect (second session)", rank1.status());
  if (auto s = (*rank1)->Attach("attach-alloc-example"); !s.ok())
    return Die("attach (second session)", s);
  auto view = (*rank1)->Map("weights");
  if (!view.ok()) return Die("map", view.status());
  const auto* seen = static_cast<const uint64_t*>((*view)->data());
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += seen[i] != i * 0x9E3779B97F4A7C15ull;
  std::printf("second session read back %zu words: %s\n", n, bad == 0 ? "all match" : "MISMATCH");

  auto status = (*rank0)->Status();
  if (!status.ok()) return Die("status", status.status());
  std::printf("pool: %llu of %llu MiB used, %u job(s), %u session(s), locked: %s\n",
              static_cast<unsigned long long>(status->used_bytes >> 20),
              static_cast<unsigned long long>(status->pool_bytes >> 20), status->jobs,
              status->sessions, status->locked ? "yes" : "no");
  if (auto s = (*rank0)->Free(*region); !s.ok()) return Die("free", s);
  std::printf("freed; detaching\n");
  return bad == 0 ? 0 : 1;
}
