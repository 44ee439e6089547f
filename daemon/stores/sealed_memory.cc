#include "daemon/stores/sealed_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/status_macros.h"
#include "proto/wire.h"

namespace tsd::stores {

absl::StatusOr<std::unique_ptr<SealedMemory>> SealedMemory::Create(uint64_t bytes,
                                                                   const char* label) {
  if (bytes == 0 || bytes % wire::kPageBytes != 0) {
    return absl::InternalError(
        absl::StrCat("store size ", bytes, " is not a positive page multiple"));
  }
  std::unique_ptr<SealedMemory> m(new SealedMemory(bytes));
  m->fd_ = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (m->fd_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create failed: ", std::strerror(errno)));
  }
  const off_t size = static_cast<off_t>(bytes);
  if (ftruncate(m->fd_, size) != 0 || fallocate(m->fd_, 0, 0, size) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("the host could not provide ",
                                                     wire::FormatBytes(bytes),
                                                     " for a store: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", wire::FormatBytes(bytes), " failed: ", std::strerror(errno)));
  }
  m->data_ = static_cast<uint8_t*>(p);
  return m;
}

SealedMemory::~SealedMemory() {
  if (data_ != nullptr) munmap(data_, bytes_);
  if (ro_data_ != nullptr) {
    if (locked_) munlock(ro_data_, bytes_);
    munmap(ro_data_, bytes_);
  }
  if (fd_ >= 0) close(fd_);
}

absl::Status SealedMemory::Seal(bool lock) {
  if (sealed_) return absl::OkStatus();
  // F_SEAL_WRITE is refused while a writable shared mapping exists: drop ours first.
  munmap(data_, bytes_);
  data_ = nullptr;
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return absl::InternalError(absl::StrCat("sealing a store failed: ", std::strerror(errno)));
  }
  sealed_ = true;
  if (lock) {
    TSD_ASSIGN_OR_RETURN(ro_data_, MapSealed());
    locked_ = mlock(ro_data_, bytes_) == 0;  // best effort: the limit may refuse it
  }
  return absl::OkStatus();
}

SealedMemory::View::~View() { munmap(const_cast<uint8_t*>(data_), bytes_); }

absl::StatusOr<std::unique_ptr<SealedMemory::View>> SealedMemory::MapReadOnly() const {
  TSD_ASSIGN_OR_RETURN(void* p, MapSealed());
  return std::make_unique<View>(static_cast<const uint8_t*>(p), bytes_);
}

absl::StatusOr<void*> SealedMemory::MapSealed() const {
  TSD_ASSIGN_OR_RETURN(const int fd, OpenReadOnly());
  void* p = mmap(nullptr, bytes_, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mapping a store's ", wire::FormatBytes(bytes_),
                     " to read them failed: ", std::strerror(errno)));
  }
  return p;
}

absl::StatusOr<int> SealedMemory::OpenReadOnly() const {
  if (!sealed_) return absl::InternalError("a store's memory is handed out only once sealed");
  // Reopening through /proc gives a new open file description, read-only: a mapping of it never
  // has VM_MAYWRITE, so no mprotect can make it writable.
  const std::string path = absl::StrCat("/proc/self/fd/", fd_);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("reopening a store read-only failed: ", std::strerror(errno)));
  }
  return fd;
}

}  // namespace tsd::stores
