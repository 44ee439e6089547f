// stream_bench: the host's memory bandwidth, STREAM-style (McCalpin's copy, scale, add and triad
// over three arrays of doubles far larger than the caches), with ordinary stores and with
// non-temporal (streaming) stores, which write whole lines without reading them first, as tsd's
// AdamW kernels' large outputs behave. bench/finetune_bench.py runs it in the same run as the
// training modes, so the bound of a tsd step (its host bytes over this bandwidth) uses the
// bandwidth of that machine at that time.
//
// Bytes are counted as STREAM counts them: copy and scale move 2 arrays, add and triad 3 (the
// read-for-ownership of ordinary stores is not counted: it is what the non-temporal kernels
// avoid). Each kernel runs --reps times; the best time counts (STREAM's rule). Threads each take
// a contiguous slice, first-touched by the same thread (so each slice sits on that thread's NUMA
// node). One JSON object is printed:
//   {"threads":16,"array_mib":512,"copy_gbs":..,"scale_gbs":..,"add_gbs":..,"triad_gbs":..,
//    "copy_nt_gbs":..,"scale_nt_gbs":..,"add_nt_gbs":..,"triad_nt_gbs":..,"nt_stores":true}
//
//   stream_bench [--threads N (default: every CPU this process may use)] [--array-mib 512] [--reps
//   5]
#include <sched.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

enum class Kernel { kCopy, kScale, kAdd, kTriad };
constexpr double kScalar = 3.0;

// One slice of one kernel. `nt`: non-temporal stores (x86-64: SSE2's movntpd, two doubles at a
// time; the line-filling buffers merge them into whole-line writes). Slices start on 64-byte
// boundaries and hold a multiple of 8 doubles.
void Run(Kernel k, bool nt, double* a, double* b, double* c, size_t n) {
#if defined(__x86_64__)
  if (nt) {
    const __m128d s = _mm_set1_pd(kScalar);
    for (size_t i = 0; i < n; i += 2) {
      switch (k) {
        case Kernel::kCopy:
          _mm_stream_pd(c + i, _mm_load_pd(a + i));
          break;
        case Kernel::kScale:
          _mm_stream_pd(b + i, _mm_mul_pd(s, _mm_load_pd(c + i)));
          break;
        case Kernel::kAdd:
          _mm_stream_pd(c + i, _mm_add_pd(_mm_load_pd(a + i), _mm_load_pd(b + i)));
          break;
        case Kernel::kTriad:
          _mm_stream_pd(a + i, _mm_add_pd(_mm_load_pd(b + i), _mm_mul_pd(s, _mm_load_pd(c + i))));
          break;
      }
    }
    _mm_sfence();
    return;
  }
#else
  (void)nt;  // no streaming stores here: both variants measure ordinary stores
#endif
  switch (k) {
    case Kernel::kCopy:
      for (size_t i = 0; i < n; ++i) c[i] = a[i];
      break;
    case Kernel::kScale:
      for (size_t i = 0; i < n; ++i) b[i] = kScalar * c[i];
      break;
    case Kernel::kAdd:
      for (size_t i = 0; i < n; ++i) c[i] = a[i] + b[i];
      break;
    case Kernel::kTriad:
      for (size_t i = 0; i < n; ++i) a[i] = b[i] + kScalar * c[i];
      break;
  }
}

int AllowedCpus() {
  cpu_set_t set;
  return sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
}

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "stream_bench: %s\nusage: stream_bench [--threads N] [--array-mib MIB] [--reps N]\n"
               "  --threads    worker threads (default: every CPU this process may use)\n"
               "  --array-mib  size of each of the three arrays (default 512; make it >= 4x the "
               "last-level cache)\n"
               "  --reps       runs of each kernel; the best counts (default 5)\n",
               why);
  std::exit(2);
}

long ParsePositive(const char* flag, const char* text, long max) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || v < 1 || v > max) {
    Usage((std::string(flag) + " takes an integer from 1 to " + std::to_string(max) + ", not '" +
           text + "'")
              .c_str());
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  long threads = AllowedCpus(), array_mib = 512, reps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") Usage("STREAM-style host memory bandwidth");
    if (i + 1 >= argc) Usage(("missing value after " + flag).c_str());
    if (flag == "--threads") {
      threads = ParsePositive("--threads", argv[++i], 4096);
    } else if (flag == "--array-mib") {
      array_mib = ParsePositive("--array-mib", argv[++i], 1 << 20);
    } else if (flag == "--reps") {
      reps = ParsePositive("--reps", argv[++i], 1000);
    } else {
      Usage(("unknown argument " + flag).c_str());
    }
  }
  // Each thread's slice: a multiple of 8 doubles (one cache line).
  const size_t n_total = static_cast<size_t>(array_mib) * (1 << 20) / sizeof(double);
  const size_t per = n_total / static_cast<size_t>(threads) / 8 * 8;
  if (per == 0) Usage("--array-mib is too small for that many threads");
  const size_t n = per * static_cast<size_t>(threads);
  double* arrays[3];
  for (double*& p : arrays) {
    p = static_cast<double*>(std::aligned_alloc(64, n * sizeof(double)));
    if (p == nullptr) Usage("out of memory for the arrays");
  }

  // Work is handed out by phase: every thread waits at the barrier, runs its slice, waits again.
  struct Phase {
    Kernel kernel;
    bool nt;
  };
  const Kernel kernels[] = {Kernel::kCopy, Kernel::kScale, Kernel::kAdd, Kernel::kTriad};
  std::vector<Phase> phases;
  for (int nt = 0; nt < 2; ++nt) {
    for (long r = 0; r < reps; ++r) {
      for (Kernel k : kernels) phases.push_back({k, nt == 1});
    }
  }
  std::vector<double> seconds(phases.size(), 0);
  std::chrono::steady_clock::time_point started;
  size_t phase = 0;
  // Completion: the last thread to arrive records the time of the phase that just ended.
  auto on_done = [&]() noexcept {
    const auto now = std::chrono::steady_clock::now();
    if (phase > 0) seconds[phase - 1] = std::chrono::duration<double>(now - started).count();
    started = std::chrono::steady_clock::now();
    ++phase;
  };
  std::barrier sync(threads, on_done);
  std::vector<std::thread> pool;
  for (long t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      double* a = arrays[0] + static_cast<size_t>(t) * per;
      double* b = arrays[1] + static_cast<size_t>(t) * per;
      double* c = arrays[2] + static_cast<size_t>(t) * per;
      for (size_t i = 0; i < per; ++i) {  // first touch: the pages go to this thread's node
        a[i] = 1.0;
        b[i] = 2.0;
        c[i] = 0.0;
      }
      sync.arrive_and_wait();  // phase 0 starts
      for (const Phase& p : phases) {
        Run(p.kernel, p.nt, a, b, c, per);
        sync.arrive_and_wait();
      }
    });
  }
  for (auto& t : pool) t.join();

  double best[2][4];
  for (auto& row : best) std::fill(std::begin(row), std::end(row), 1e30);
  for (size_t i = 0; i < phases.size(); ++i) {
    double& b = best[phases[i].nt ? 1 : 0][static_cast<int>(phases[i].kernel)];
    b = std::min(b, seconds[i]);
  }
  const double bytes = static_cast<double>(n) * sizeof(double);
  const double moved[4] = {2 * bytes, 2 * bytes, 3 * bytes, 3 * bytes};
  const char* names[4] = {"copy", "scale", "add", "triad"};
  // A checksum of what the kernels left, printed so the compiler cannot drop them.
  double check = 0;
  for (size_t i = 0; i < n; i += 4096) check += arrays[0][i] + arrays[1][i] + arrays[2][i];
  std::printf("{\"threads\":%ld,\"array_mib\":%ld,\"reps\":%ld", threads, array_mib, reps);
  for (int nt = 0; nt < 2; ++nt) {
    for (int k = 0; k < 4; ++k) {
      std::printf(",\"%s%s_gbs\":%.2f", names[k], nt ? "_nt" : "", moved[k] / best[nt][k] / 1e9);
    }
  }
#if defined(__x86_64__)
  std::printf(",\"nt_stores\":true");
#else
  std::printf(",\"nt_stores\":false");
#endif
  std::printf(",\"checksum\":%.6g}\n", check);
  for (double* p : arrays) std::free(p);
  return 0;
}
