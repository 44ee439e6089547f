// Runtime ISA selection and the public entry points of the CPU AdamW kernels.
#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/sr_hash.h"

namespace tsd::kernels {
namespace {

// F16C: CPUID leaf 1, ECX bit 29 (clang before 15 does not know "f16c" in
// __builtin_cpu_supports; the fuzzing build, scripts/fuzz.sh, uses clang-14).
bool CpuHasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & (1u << 29)) != 0;
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool CpuHasAvx512Bf16() {
  __builtin_cpu_init();
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
}

Isa DetectBestIsa() {
  if (CpuHasAvx512()) return Isa::kAvx512;
  if (CpuHasAvx2()) return Isa::kAvx2;
  return Isa::kScalar;
}

// The best supported ISA not above `isa`.
Isa Supported(Isa isa) {
  if (isa == Isa::kAvx512 && !IsaSupported(Isa::kAvx512)) isa = Isa::kAvx2;
  if (isa == Isa::kAvx2 && !IsaSupported(Isa::kAvx2)) isa = Isa::kScalar;
  if (isa != Isa::kAvx512 && isa != Isa::kAvx2) isa = Isa::kScalar;
  return isa;
}

std::atomic<int>& Bf16InsnFlag() {
  static std::atomic<int> flag{CpuHasAvx512Bf16() ? 1 : 0};
  return flag;
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool IsaSupported(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2: {
      static const bool ok = CpuHasAvx2();
      return ok;
    }
    case Isa::kAvx512: {
      static const bool ok = CpuHasAvx512();
      return ok;
    }
  }
  return false;
}

Isa BestIsa() {
  static const Isa isa = detail::ResolveIsa(std::getenv("TSD_KERNEL_ISA"));
  return isa;
}

size_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

namespace detail {

Isa ResolveIsa(const char* env_value) {
  const Isa best = DetectBestIsa();
  if (env_value == nullptr) return best;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(env_value, IsaName(isa)) == 0) return IsaSupported(isa) ? isa : best;
  }
  return best;
}

void SetAvx512UseBf16Insn(bool enabled) {
  Bf16InsnFlag().store(enabled && CpuHasAvx512Bf16() ? 1 : 0, std::memory_order_relaxed);
}

bool Avx512UseBf16Insn() { return Bf16InsnFlag().load(std::memory_order_relaxed) != 0; }

AdamWCoeffs MakeAdamWCoeffs(const AdamWHyper& h) {
  AdamWCoeffs c;
  // Python evaluates these in double; ATen casts each scalar argument to float.
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.lerp_weight = static_cast<float>(1.0 - h.beta1);
  c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
  c.lerp_coef = c.lerp_small ? c.lerp_weight : c.lerp_weight - 1.0f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const double step = static_cast<double>(h.step);
  const double bias_correction1 = 1.0 - std::pow(h.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bias_correction1;
  c.bc2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));  // Python: bc2 ** 0.5
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  c.grad_scale = h.grad_scale;
  c.scale_grad = h.grad_scale != 1.0f;
  return c;
}

}  // namespace detail

void AdamWStep(const AdamWTensors& t, const AdamWHyper& h, Isa isa) {
  if (t.n <= 0) return;
  isa = Supported(isa);
  detail::AdamWCoeffs c = detail::MakeAdamWCoeffs(h);
  const size_t gsz = DTypeSize(t.grad_dtype);
  const size_t msz = DTypeSize(t.moment_dtype);
  const size_t psz = DTypeSize(t.param_dtype);
  // Split the range at 2^32 boundaries of the bucket index so that each kernel call sees one
  // constant high word (and so one pair of stochastic-rounding keys).
  int64_t done = 0;
  while (done < t.n) {
    const uint64_t index = static_cast<uint64_t>(t.sr_offset) + static_cast<uint64_t>(done);
    const uint64_t room = (uint64_t{1} << 32) - (index & 0xFFFFFFFFull);
    const int64_t len = static_cast<int64_t>(std::min<uint64_t>(room, t.n - done));
    AdamWTensors s = t;
    s.grad = static_cast<const char*>(t.grad) + done * gsz;
    s.master = t.master + done;
    s.exp_avg = static_cast<char*>(t.exp_avg) + done * msz;
    s.exp_avg_sq = static_cast<char*>(t.exp_avg_sq) + done * msz;
    s.param_out = t.param_out ? static_cast<char*>(t.param_out) + done * psz : nullptr;
    s.n = len;
    s.sr_offset = static_cast<int64_t>(index);
    const uint32_t hi = static_cast<uint32_t>(index >> 32);
    c.key_exp_avg = SrKey(t.sr_seed, hi, kSrStreamExpAvg);
    c.key_exp_avg_sq = SrKey(t.sr_seed, hi, kSrStreamExpAvgSq);
    switch (isa) {
      case Isa::kAvx512:
        detail::AdamWStepAvx512(s, c);
        break;
      case Isa::kAvx2:
        detail::AdamWStepAvx2(s, c);
        break;
      default:
        detail::AdamWStepScalar(s, c);
        break;
    }
    done += len;
  }
}

void AccumulateGrad(const void* grad, DType dtype, float* acc, int64_t n, bool first, Isa isa) {
  if (n <= 0) return;
  switch (Supported(isa)) {
    case Isa::kAvx512:
      return detail::AccumulateGradAvx512(grad, dtype, acc, n, first);
    case Isa::kAvx2:
      return detail::AccumulateGradAvx2(grad, dtype, acc, n, first);
    default:
      return detail::AccumulateGradScalar(grad, dtype, acc, n, first);
  }
}

double SumSquares(const void* grad, DType dtype, int64_t n, Isa isa) {
  if (n <= 0) return 0.0;
  switch (Supported(isa)) {
    case Isa::kAvx512:
      return detail::SumSquaresAvx512(grad, dtype, n);
    case Isa::kAvx2:
      return detail::SumSquaresAvx2(grad, dtype, n);
    default:
      return detail::SumSquaresScalar(grad, dtype, n);
  }
}

}  // namespace tsd::kernels
