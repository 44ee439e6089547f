// SealedMemory is the memory of one store: an unnamed memfd that tsd fills once and then seals
// (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL), so from then on nobody, the daemon
// included, can change or resize a byte. Clients get a descriptor reopened read-only, so a
// mapping of it can never become writable (mmap with PROT_WRITE and mprotect are refused, a
// write through it faults). While it is being filled it is mapped writable in the daemon only;
// a SealedMemory that was never sealed is simply dropped (a build that failed leaves nothing).
//
// Pages come back to the kernel when the daemon and every client have closed and unmapped the
// memfd (a sealed file cannot be punched, unlike a Region's).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace tsd::stores {

class SealedMemory final {
 public:
  // A writable memfd of `bytes` (a positive page multiple), every page allocated now.
  static absl::StatusOr<std::unique_ptr<SealedMemory>> Create(uint64_t bytes, const char* label);
  ~SealedMemory();
  SealedMemory(const SealedMemory&) = delete;
  SealedMemory& operator=(const SealedMemory&) = delete;

  uint64_t bytes() const { return bytes_; }
  // The writable mapping while filling (nullptr once sealed).
  uint8_t* data() const { return data_; }
  // Unmaps the writable mapping and seals the memfd; `lock` keeps a read-only mapping mlock()ed
  // in the daemon (the lock is best effort: false in locked() when the limit refuses it; a
  // mapping that fails is an error).
  absl::Status Seal(bool lock);
  bool sealed() const { return sealed_; }
  bool locked() const { return locked_; }
  // A new read-only descriptor of the sealed memfd (O_RDONLY, close-on-exec); the caller owns it.
  absl::StatusOr<int> OpenReadOnly() const;

  // A read-only mapping of the sealed bytes for the daemon's own reads (a device copy's source):
  // unmapped when the view goes. `data()` above is null once sealed.
  class View {
   public:
    View(const uint8_t* data, uint64_t bytes) : data_(data), bytes_(bytes) {}
    ~View();
    View(const View&) = delete;
    View& operator=(const View&) = delete;
    const uint8_t* data() const { return data_; }

   private:
    const uint8_t* data_;
    uint64_t bytes_;
  };
  absl::StatusOr<std::unique_ptr<View>> MapReadOnly() const;

 private:
  explicit SealedMemory(uint64_t bytes) : bytes_(bytes) {}
  // A read-only mapping of the whole sealed memfd through a descriptor of OpenReadOnly(); the
  // caller unmaps it.
  absl::StatusOr<void*> MapSealed() const;

  const uint64_t bytes_;
  int fd_ = -1;
  uint8_t* data_ = nullptr;  // writable, until sealed
  void* ro_data_ = nullptr;  // read-only and locked, after sealing (when asked)
  bool sealed_ = false;
  bool locked_ = false;
};

}  // namespace tsd::stores
