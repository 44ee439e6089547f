// Fuzzes tsd's configuration reader: each input is a TOML file (in a memfd, read through its
// /proc/self/fd path) loaded with LoadConfig as `tsd --config FILE` would, so toml++'s parser,
// the settings table's types and ranges, and the resolution of sizes, shares and durations all
// see it. A file that is refused must be refused with a message; nothing may crash.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "daemon/ops/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz-config", MFD_CLOEXEC);
  if (fd < 0) return 0;
  for (size_t at = 0; at < size;) {
    const ssize_t n = write(fd, data + at, size - at);
    if (n <= 0) break;
    at += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  auto loaded = tsd::LoadConfig(std::vector<std::string>{"tsd", "--config", path});
  if (!loaded.ok() && loaded.status().message().empty()) std::abort();
  if (loaded.ok()) (void)tsd::ConfigToToml(loaded->config);
  close(fd);
  return 0;
}
