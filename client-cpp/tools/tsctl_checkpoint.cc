// tsctl checkpoint: the caller's side of a background checkpoint. tsd writes the state (on one of
// its request workers, not its socket thread) into a descriptor this process opened with the
// caller's own permissions, so tsd can neither be made to write where the caller may not, nor
// leave a half-written file under the final name: the temporary file becomes FILE only after
// the daemon finished and the data is on disk.
#include "tsctl_checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

namespace tsd::tools {
namespace {

std::string DirOf(const std::string& file) {
  const size_t slash = file.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return file.substr(0, slash);
}

std::string BaseOf(const std::string& file) {
  const size_t slash = file.rfind('/');
  return slash == std::string::npos ? file : file.substr(slash + 1);
}

int Fail(const std::string& why) {
  std::fprintf(stderr, "tsctl checkpoint: %s\n", why.c_str());
  return 1;
}

}  // namespace

int Checkpoint(Client& client, const std::string& job, const std::string& file) {
  if (file.empty() || file.back() == '/') return Fail("FILE must name a file, not a directory");
  const std::string dir = DirOf(file);
  std::string pattern = dir + "/." + BaseOf(file) + ".tmp-XXXXXX";
  std::vector<char> path(pattern.begin(), pattern.end());
  path.push_back('\0');
  const int fd = mkostemp(path.data(), O_CLOEXEC);  // 0600, as the caller
  if (fd < 0) {
    return Fail("cannot create a temporary file in " + dir + ": " + std::strerror(errno) +
                " (the directory must exist and be writable by you)");
  }
  const std::string tmp(path.data());
  auto abandon = [&](const std::string& why) {
    close(fd);
    unlink(tmp.c_str());
    return Fail(why + "; " + file + " was not changed");
  };
  auto written = client.Checkpoint(job, fd);
  if (!written.ok()) return abandon(std::string(written.status().message()));
  if (fsync(fd) != 0) return abandon(std::string("fsync failed: ") + std::strerror(errno));
  if (close(fd) != 0) {
    unlink(tmp.c_str());
    return Fail(std::string("closing the temporary file failed: ") + std::strerror(errno));
  }
  if (rename(tmp.c_str(), file.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return Fail("renaming " + tmp + " to " + file + " failed: " + std::strerror(err));
  }
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd);  // the rename itself survives a crash
    close(dfd);
  }
  std::printf("checkpoint of job '%s': %llu bytes written to %s (safetensors, xxh3-64 checksums)\n",
              job.c_str(), static_cast<unsigned long long>(*written), file.c_str());
  return 0;
}

}  // namespace tsd::tools
