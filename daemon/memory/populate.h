// Populate faults every page of a fresh shared mapping in before the daemon hands it out, with
// several threads. The kernel zero-fills each page of a memfd on its first touch, and one thread
// does that slowly on a virtual machine: on the 2-core development VM a single-threaded
// MAP_POPULATE of a 198M-parameter model's 2.95 GiB of optimizer state took 14 to 21 s of wrap(),
// 80% of it in clear_page under the fault. The threads split the range into chunks and fault them
// in with madvise(MADV_POPULATE_WRITE) (Linux 5.14), or by writing one byte per page on older
// kernels. New threads inherit the caller's memory policy, so a region placed on a NUMA node stays
// there.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace tsd {

// Whether the kernel knows madvise(MADV_POPULATE_WRITE) (Linux 5.14); without it PopulateMapping
// writes one byte of every page.
bool PopulateWriteSupported();

// How many threads PopulateMapping uses for `bytes` when given 0: one per 256 MiB, at most the
// CPUs this thread may run on and at most 16.
int PopulateThreads(uint64_t bytes);

// Faults in every page of [data, data + bytes) for writing (data page-aligned, bytes a multiple
// of the page size), with `threads` threads (0: PopulateThreads(bytes); 1: on the calling thread).
// The contents are not changed. An error names the failing range and errno.
absl::Status PopulateMapping(void* data, uint64_t bytes, int threads = 0);

}  // namespace tsd
