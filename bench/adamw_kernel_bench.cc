// Throughput of the CPU AdamW kernels, per ISA, single-threaded, in Gparam/s (the daemon
// parallelises by splitting ranges). 16M parameters: bf16 gradients in, fp32 master, fp32 or
// bf16 moments, bf16 params out. Unsupported ISAs are reported as skipped. The AdamW step also
// runs on its first 16K parameters (/16384: the buffers stay in the core's L2), where memory is out
// of the way: the core's arithmetic limit, which a host with fewer cores than memory wants (or
// cores shared by two hyperthreads) meets before its memory bandwidth.
//
//   adamw_kernel_bench [--benchmark_filter=AdamW] [--benchmark_repetitions=3]
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"

namespace {

using tsd::kernels::AdamWHyper;
using tsd::kernels::AdamWTensors;
using tsd::kernels::DType;
using tsd::kernels::Isa;

constexpr int64_t kN = int64_t{16} << 20;
constexpr int64_t kInCache = int64_t{16} << 10;

// Deterministic pseudo-random values in [-1, 1).
float Value(uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<float>(static_cast<int64_t>(x & 0xFFFFFF) - 0x800000) * 0x1p-23f;
}

// A 64-byte aligned array, as tsd's regions place every bucket: the kernels store the working
// parameter non-temporally only where its range is aligned.
template <class T>
class Aligned {
 public:
  explicit Aligned(int64_t n)
      : p_(static_cast<T*>(
            std::aligned_alloc(64, (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64))) {
    if (p_ == nullptr) std::abort();
  }
  ~Aligned() { std::free(p_); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  T* data() { return p_; }
  T& operator[](int64_t i) { return p_[i]; }

 private:
  T* p_;
};

// Buffers shared by all benchmarks (allocated and touched once, outside the timed loops).
struct Buffers {
  Aligned<uint16_t> grad, param, m16, v16;
  Aligned<float> master, m32, v32;
  Buffers() : grad(kN), param(kN), m16(kN), v16(kN), master(kN), m32(kN), v32(kN) {
    for (int64_t i = 0; i < kN; ++i) {
      grad[i] = tsd::kernels::F32ToBf16Rne(Value(i) * 0.01f);
      master[i] = Value(i + kN);
      m32[i] = 0.0f;
      v32[i] = 0.0f;
      m16[i] = 0;
      v16[i] = 0;
      param[i] = 0;
    }
  }
};

Buffers& Shared() {
  static Buffers b;
  return b;
}

bool Skip(benchmark::State& state, Isa isa) {
  if (tsd::kernels::IsaSupported(isa)) return false;
  state.SkipWithError("ISA not supported on this CPU");
  for (auto _ : state) {
  }
  return true;
}

void BM_AdamW(benchmark::State& state, Isa isa, DType moment_dtype) {
  if (Skip(state, isa)) return;
  Buffers& b = Shared();
  const int64_t n = state.range(0);  // the first n parameters of the buffers
  const bool bf16 = moment_dtype == DType::kBF16;
  AdamWTensors t;
  t.grad = b.grad.data();
  t.grad_dtype = DType::kBF16;
  t.master = b.master.data();
  t.exp_avg = bf16 ? static_cast<void*>(b.m16.data()) : b.m32.data();
  t.exp_avg_sq = bf16 ? static_cast<void*>(b.v16.data()) : b.v32.data();
  t.moment_dtype = moment_dtype;
  t.param_out = b.param.data();
  t.param_dtype = DType::kBF16;
  t.n = n;
  t.sr_seed = 1234;
  t.sr_offset = 0;
  int64_t step = 0;
  for (auto _ : state) {
    AdamWHyper h;
    h.step = ++step;
    tsd::kernels::AdamWStep(t, h, isa);
    benchmark::ClobberMemory();
  }
  const double done = static_cast<double>(state.iterations()) * static_cast<double>(n);
  state.counters["Gparam/s"] = benchmark::Counter(done * 1e-9, benchmark::Counter::kIsRate);
  // Bytes moved per element: grad 2 + master 4+4 + moments 2*(s+s) + param 2.
  const int64_t per_elem = 2 + 8 + (bf16 ? 8 : 16) + 2;
  state.SetBytesProcessed(state.iterations() * n * per_elem);
}

void BM_AccumulateGrad(benchmark::State& state, Isa isa) {
  if (Skip(state, isa)) return;
  Buffers& b = Shared();
  for (auto _ : state) {
    tsd::kernels::AccumulateGrad(b.grad.data(), DType::kBF16, b.m32.data(), kN, false, isa);
    benchmark::ClobberMemory();
  }
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(kN);
  state.counters["Gparam/s"] = benchmark::Counter(n * 1e-9, benchmark::Counter::kIsRate);
}

void BM_SumSquares(benchmark::State& state, Isa isa) {
  if (Skip(state, isa)) return;
  Buffers& b = Shared();
  for (auto _ : state) {
    benchmark::DoNotOptimize(tsd::kernels::SumSquares(b.grad.data(), DType::kBF16, kN, isa));
  }
  const double n = static_cast<double>(state.iterations()) * static_cast<double>(kN);
  state.counters["Gparam/s"] = benchmark::Counter(n * 1e-9, benchmark::Counter::kIsRate);
}

#define TSD_ADAMW_BENCH(isa_name, isa)                                                       \
  BENCHMARK_CAPTURE(BM_AdamW, isa_name##_f32moments, isa, DType::kF32)                       \
      ->Arg(kN)                                                                              \
      ->Arg(kInCache)                                                                        \
      ->Unit(benchmark::kMicrosecond)                                                        \
      ->UseRealTime();                                                                       \
  BENCHMARK_CAPTURE(BM_AdamW, isa_name##_bf16moments, isa, DType::kBF16)                     \
      ->Arg(kN)                                                                              \
      ->Arg(kInCache)                                                                        \
      ->Unit(benchmark::kMicrosecond)                                                        \
      ->UseRealTime();                                                                       \
  BENCHMARK_CAPTURE(BM_AccumulateGrad, isa_name##_bf16, isa)->Unit(benchmark::kMillisecond); \
  BENCHMARK_CAPTURE(BM_SumSquares, isa_name##_bf16, isa)->Unit(benchmark::kMillisecond)

TSD_ADAMW_BENCH(scalar, Isa::kScalar);
TSD_ADAMW_BENCH(avx2, Isa::kAvx2);
TSD_ADAMW_BENCH(avx512, Isa::kAvx512);

}  // namespace

BENCHMARK_MAIN();
