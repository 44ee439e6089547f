// CPU AdamW kernels of tsd: one fused pass per element over a contiguous range of a bucket.
//
// Numerics. AdamWStep computes, bit for bit, what torch.optim.AdamW (single-tensor path,
// foreach=False, fused=False, amsgrad=False, maximize=False, fp32 tensors) computes on a CPU where
// PyTorch runs its AVX2 or AVX-512 kernels (every x86-64 CPU with AVX2). Per element, in fp32,
// with the scalars rounded to float as PyTorch rounds them:
//
//   g     = float(grad)                       ; g *= grad_scale unless grad_scale == 1
//   p     = p * float(1 - lr*wd)              (param.mul_)
//   w     = float(1 - beta1)
//   m     = |w| < 0.5 ? fma(w, g - m, m)      (exp_avg.lerp_(grad, 1-beta1); ATen's vectorised
//                     : fma(w - 1, g - m, g)   lerp uses fmadd, both branches as ATen has them)
//   v     = fma(float(1-beta2) * g, g, v * float(beta2))   (mul_ then addcmul_, fused by ATen)
//   denom = sqrt(v) / float(sqrt(1 - beta2^step)) + float(eps)
//   p     = p + (float(-lr / (1 - beta1^step)) * m) / denom  (addcdiv_: (value * t1) / t2)
//
// The bias corrections are computed in double exactly as Python does. Checked against torch 2.11
// (CPU capability AVX512 and AVX2, 12 steps, 4.8M element-steps): exp_avg and exp_avg_sq are
// bit-identical; p is bit-identical once torch's own sqrt is used in the formula. Here sqrt is
// IEEE (correctly rounded); torch's CPU sqrt goes through MKL VML, which is 1 ulp off for ~0.6%
// of inputs, and that changes p by 1 ulp in ~2e-5 of element-steps. PyTorch's portable
// "DEFAULT" CPU capability does not fuse the lerp/addcmul and so differs by rounding only.
// All ISA paths (scalar, AVX2, AVX-512) produce identical bits; the scalar path uses std::fma.
// NaN/Inf in gradients propagate as IEEE arithmetic of the formula does.
//
// bf16 moments are loaded exactly, updated in fp32 as above (the update of p uses the unrounded
// fp32 moments) and stored with stochastic rounding (see bf16.h, sr_hash.h). Conversions to a
// 16-bit param copy use round-to-nearest-even.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tsd::kernels {

// Element type of a buffer.
enum class DType : uint8_t {
  kF32 = 0,   // IEEE binary32
  kBF16 = 1,  // bfloat16 (top 16 bits of a binary32)
  kF16 = 2,   // IEEE binary16
};

// Instruction-set path of the kernels.
enum class Isa : uint8_t {
  kScalar = 0,  // portable x86-64 code
  kAvx2 = 1,    // AVX2 + FMA + F16C, 8 floats per vector
  kAvx512 = 2,  // AVX-512 F/BW/VL (+ AVX512_BF16 where the CPU has it), 16 floats per vector
};

// Lower-case name of an ISA: "scalar", "avx2" or "avx512" ("unknown" for other values).
const char* IsaName(Isa isa);

// The ISA the kernels should use on this CPU: the best supported one, unless the environment
// variable TSD_KERNEL_ISA (scalar|avx2|avx512) names a supported ISA, which is then returned. An
// unknown or unsupported request is ignored (the best ISA is returned), so callers can log
// BestIsa() to see what is really used. Evaluated once; thread-safe.
Isa BestIsa();

// Whether this CPU (and OS) can run `isa`: kAvx2 needs AVX2, FMA and F16C; kAvx512 needs
// AVX-512 F, BW and VL in addition (AVX512_BF16 is used when present, not required).
bool IsaSupported(Isa isa);

// Bytes per element of `dtype` (4 or 2).
size_t DTypeSize(DType dtype);

// Hyperparameters of one step of one parameter group, exactly torch.optim.AdamW's
// (amsgrad=False, maximize=False).
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;      // 1-based step count of this parameter group, after increment (>= 1)
  float grad_scale = 1;  // gradients are multiplied by this first (clip coefficient), in fp32;
                         // exactly 1 skips the multiply
};

// One contiguous range of a bucket. All buffers hold `n` elements and must not overlap, except
// that param_out may equal master when param_dtype is kF32.
struct AdamWTensors {
  const void* grad = nullptr;  // gradients: fp32, bf16 or fp16
  DType grad_dtype = DType::kF32;
  float* master = nullptr;           // fp32 master weights, updated in place
  void* exp_avg = nullptr;           // first moment, updated in place
  void* exp_avg_sq = nullptr;        // second moment, updated in place
  DType moment_dtype = DType::kF32;  // kF32 or kBF16 (bf16 is stored with stochastic rounding)
  void* param_out = nullptr;         // nullptr: no copy; else master converted (RNE) to param_dtype
  DType param_dtype = DType::kF32;
  int64_t n = 0;          // number of elements (<= 0: nothing is done)
  uint64_t sr_seed = 0;   // seed for the stochastic rounding of bf16 moments
  int64_t sr_offset = 0;  // element index of master[0] within the whole bucket, so results do not
                          // depend on how a bucket is split among threads
};

// One AdamW step over `t` (see the top of this file for the exact arithmetic) using `isa`.
// The ISA should be supported (IsaSupported); an unsupported one is replaced by the best
// supported ISA below it rather than crashing. Results are bit-identical for every ISA and for
// every split of a bucket into ranges (given the matching sr_offset).
void AdamWStep(const AdamWTensors& t, const AdamWHyper& h, Isa isa);

// The inverse of AdamWStep(t, h) (up to rounding: within a few ulps for fp32 moments, within
// their 8-bit rounding for bf16 ones): restores the master, the moments and the param copy to
// what they were before that step, given the same gradient and hyperparameters. The daemon's
// speculative clipping undoes a step made before the gradient norm was known with it. Scalar
// code; the sr fields are unused (moments are stored rounded to nearest).
void AdamWUndo(const AdamWTensors& t, const AdamWHyper& h);

// Gradient accumulation: acc[i] = float(grad[i]) when `first` (a copy, so -0 stays -0), else
// acc[i] = acc[i] + float(grad[i]) in fp32. Bit-identical across ISAs.
void AccumulateGrad(const void* grad, DType dtype, float* acc, int64_t n, bool first, Isa isa);

// Sum over i of float(grad[i])^2, squares and sums in double (each square is exact). The
// summation order depends on the ISA, so results may differ in the last bits between ISAs. NaN
// or Inf in the input gives NaN or Inf (used to detect non-finite gradients).
double SumSquares(const void* grad, DType dtype, int64_t n, Isa isa);

// ---------------------------------------------------------------------------------------------
// Implementation details shared by the ISA translation units (and the tests). Not a stable API.
namespace detail {

// The float scalars of one step, derived from AdamWHyper as PyTorch derives them.
struct AdamWCoeffs {
  float decay = 1;            // float(1 - lr * weight_decay)
  float lerp_weight = 0;      // w = float(1 - beta1)
  bool lerp_small = true;     // |w| < 0.5: m = fma(w, g - m, m); else m = fma(w - 1, g - m, g)
  float lerp_coef = 0;        // w when lerp_small, else w - 1
  float beta2 = 0;            // float(beta2)
  float one_minus_beta2 = 0;  // float(1 - beta2)
  float bc2_sqrt = 1;         // float(sqrt(1 - beta2^step)), the sqrt as Python's ** 0.5
  float eps = 0;              // float(eps)
  float neg_step_size = 0;    // float(-(lr / (1 - beta1^step)))
  float grad_scale = 1;
  bool scale_grad = false;  // grad_scale != 1
  // Stochastic-rounding keys (SrKey) of the 2^32-index block the current range lies in.
  uint32_t key_exp_avg = 0;
  uint32_t key_exp_avg_sq = 0;
};

AdamWCoeffs MakeAdamWCoeffs(const AdamWHyper& h);

// Per-ISA entry points. For AdamWStep*, all of [t.sr_offset, t.sr_offset + t.n) must lie in one
// 2^32 block of indices (AdamWStep splits ranges to ensure this) and t.n > 0.
void AdamWStepScalar(const AdamWTensors& t, const AdamWCoeffs& c);
void AdamWStepAvx2(const AdamWTensors& t, const AdamWCoeffs& c);
void AdamWStepAvx512(const AdamWTensors& t, const AdamWCoeffs& c);
void AccumulateGradScalar(const void* grad, DType dtype, float* acc, int64_t n, bool first);
void AccumulateGradAvx2(const void* grad, DType dtype, float* acc, int64_t n, bool first);
void AccumulateGradAvx512(const void* grad, DType dtype, float* acc, int64_t n, bool first);
double SumSquaresScalar(const void* grad, DType dtype, int64_t n);
double SumSquaresAvx2(const void* grad, DType dtype, int64_t n);
double SumSquaresAvx512(const void* grad, DType dtype, int64_t n);

// The ISA BestIsa() picks for a TSD_KERNEL_ISA value (nullptr: unset).
Isa ResolveIsa(const char* env_value);

// Whether the AVX-512 path converts bf16 params with AVX512_BF16 (VCVTNEPS2BF16) or with integer
// code. Defaults to "when the CPU has AVX512_BF16"; tests switch it to compare both (the results
// are identical). Setting true on a CPU without AVX512_BF16 is ignored.
void SetAvx512UseBf16Insn(bool enabled);
bool Avx512UseBf16Insn();

}  // namespace detail
}  // namespace tsd::kernels
