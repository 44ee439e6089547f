// Tests of the CPU AdamW kernels (kernels/cpu/adamw.h).
//
// What is checked, and the bounds used:
//  * Conversions (bf16.h) against independent oracles: a nearest-neighbour search for bf16 and
//    the compiler's _Float16 for fp16 (exact bits; NaN must stay NaN).
//  * Every supported ISA against an fp32 transcription of PyTorch's AdamW written here (bit
//    exact: 0 ulp; NaN lanes must be NaN in both).
//  * Every supported ISA against a double-precision reference of the same formula, 20 steps with
//    a changing lr, within a running first-order rounding-error bound derived below (x2 slack).
//  * The AVX2 and AVX-512 paths against the scalar path: bit-identical (bound 0 ulp), including
//    edge values (zeros, subnormals, 1e30, NaN, Inf).
//  * Stochastic rounding: unbiased within 5 sigma over 1e6 samples, always one of the two bf16
//    neighbours, identical bits in every ISA, independent of how a range is split.
//  * AccumulateGrad and SumSquares against simple loops.
//
// Built with -ffp-contract=off so that the fp32 transcription rounds where it says it does.
// TSD_TEST_VERBOSE=1 prints, per dtype combination, the largest error/bound ratio of the
// double-reference test.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bf16.h"
#include "kernels/cpu/sr_hash.h"

namespace tsd::kernels {

// Readable ISA names in GoogleTest messages.
void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }

namespace {

constexpr double kU = 0x1p-24;  // unit roundoff of fp32 (half an ulp, relative)
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ------------------------------------------------------------------------------------------------
// Helpers.

// A buffer of n elements of one dtype.
class Buf {
 public:
  Buf() = default;
  Buf(DType dtype, size_t n) : dtype_(dtype), bytes_(n * DTypeSize(dtype)) {}
  DType dtype() const { return dtype_; }
  size_t size() const { return bytes_.size() / DTypeSize(dtype_); }
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  uint32_t Bits(size_t i) const {
    if (dtype_ == DType::kF32) {
      uint32_t b;
      std::memcpy(&b, bytes_.data() + 4 * i, 4);
      return b;
    }
    uint16_t h;
    std::memcpy(&h, bytes_.data() + 2 * i, 2);
    return h;
  }
  void SetBits(size_t i, uint32_t b) {
    if (dtype_ == DType::kF32) {
      std::memcpy(bytes_.data() + 4 * i, &b, 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(b);
      std::memcpy(bytes_.data() + 2 * i, &h, 2);
    }
  }
  float Get(size_t i) const {
    switch (dtype_) {
      case DType::kBF16:
        return Bf16ToF32(static_cast<uint16_t>(Bits(i)));
      case DType::kF16:
        return F16ToF32(static_cast<uint16_t>(Bits(i)));
      default:
        return std::bit_cast<float>(Bits(i));
    }
  }
  // Stores x rounded to nearest even.
  void Set(size_t i, float x) {
    switch (dtype_) {
      case DType::kBF16:
        SetBits(i, F32ToBf16Rne(x));
        break;
      case DType::kF16:
        SetBits(i, F32ToF16Rne(x));
        break;
      default:
        SetBits(i, std::bit_cast<uint32_t>(x));
    }
  }
  bool IsNan(size_t i) const { return std::isnan(Get(i)); }

 private:
  DType dtype_ = DType::kF32;
  std::vector<unsigned char> bytes_;
};

const char* DTypeName(DType d) {
  switch (d) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

// One dtype combination: grad, moments, and param output (has_param false: param_out nullptr).
struct Combo {
  DType grad;
  DType moment;
  bool has_param;
  DType param;
  std::string Name() const {
    return std::string("grad=") + DTypeName(grad) + " moments=" + DTypeName(moment) +
           " param=" + (has_param ? DTypeName(param) : "none");
  }
};

std::vector<Combo> AllCombos() {
  std::vector<Combo> out;
  for (DType g : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (DType m : {DType::kF32, DType::kBF16}) {
      out.push_back({g, m, false, DType::kF32});
      for (DType p : {DType::kF32, DType::kBF16, DType::kF16}) out.push_back({g, m, true, p});
    }
  }
  return out;
}

// All buffers of one AdamW problem; copyable, so two paths can run on identical inputs.
struct Problem {
  Combo combo;
  size_t n = 0;
  Buf grad, exp_avg, exp_avg_sq, param;
  std::vector<float> master;
  uint64_t sr_seed = 0x5EED5EED12345678ull;
  int64_t sr_offset = 0;

  Problem(const Combo& c, size_t n_)
      : combo(c),
        n(n_),
        grad(c.grad, n_),
        exp_avg(c.moment, n_),
        exp_avg_sq(c.moment, n_),
        param(c.param, n_),
        master(n_, 0.0f) {}

  AdamWTensors Tensors() {
    return AdamWTensors{grad.data(),
                        combo.grad,
                        master.data(),
                        exp_avg.data(),
                        exp_avg_sq.data(),
                        combo.moment,
                        combo.has_param ? param.data() : nullptr,
                        combo.param,
                        static_cast<int64_t>(n),
                        sr_seed,
                        sr_offset};
  }
};

std::vector<float> Normal(size_t n, uint64_t seed, float stddev, float mean = 0.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

// Fills the problem with random data: master ~ N(0,1), moments as given (zero when !random_state)
// and gradients ~ N(0, 0.5) stored in the grad dtype.
void FillRandom(Problem& pr, uint64_t seed, bool random_state) {
  const std::vector<float> p = Normal(pr.n, seed, 1.0f);
  const std::vector<float> g = Normal(pr.n, seed + 1, 0.5f);
  const std::vector<float> m = Normal(pr.n, seed + 2, 0.1f);
  const std::vector<float> v = Normal(pr.n, seed + 3, 0.01f);
  for (size_t i = 0; i < pr.n; ++i) {
    pr.master[i] = p[i];
    pr.grad.Set(i, g[i]);
    pr.exp_avg.Set(i, random_state ? m[i] : 0.0f);
    pr.exp_avg_sq.Set(i, random_state ? std::fabs(v[i]) : 0.0f);
  }
}

void SetGrads(Problem& pr, uint64_t seed, float stddev) {
  const std::vector<float> g = Normal(pr.n, seed, stddev);
  for (size_t i = 0; i < pr.n; ++i) pr.grad.Set(i, g[i]);
}

// Bits of x rounded to nearest even in dtype d.
uint32_t RoundedBits(DType d, float x) {
  switch (d) {
    case DType::kBF16:
      return F32ToBf16Rne(x);
    case DType::kF16:
      return F32ToF16Rne(x);
    default:
      return std::bit_cast<uint32_t>(x);
  }
}

bool SameOrBothNan(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
         (std::isnan(a) && std::isnan(b));
}

// Distance in ulps between two floats of the same sign class (ordered-integer difference).
int64_t UlpDiff(float a, float b) {
  auto key = [](float x) {
    const int32_t i = std::bit_cast<int32_t>(x);
    return i < 0 ? static_cast<int64_t>(std::numeric_limits<int32_t>::min()) - i
                 : static_cast<int64_t>(i);
  };
  return std::llabs(key(a) - key(b));
}

// Compares two problems' outputs element by element: bit-identical, or NaN in both. Returns the
// number of mismatches, reporting the first few, and records the largest ulp distance of fp32
// outputs in *max_ulp.
size_t CompareOutputs(const Problem& a, const Problem& b, const std::string& what,
                      int64_t* max_ulp = nullptr) {
  size_t bad = 0;
  auto report = [&](const char* field, size_t i, float x, float y) {
    if (++bad <= 5) {
      ADD_FAILURE() << what << ": " << field << "[" << i << "] " << x << " (0x" << std::hex
                    << std::bit_cast<uint32_t>(x) << ") vs " << y << " (0x"
                    << std::bit_cast<uint32_t>(y) << std::dec << ")";
    }
  };
  for (size_t i = 0; i < a.n; ++i) {
    if (!SameOrBothNan(a.master[i], b.master[i])) report("master", i, a.master[i], b.master[i]);
    if (max_ulp && !std::isnan(a.master[i]) && !std::isnan(b.master[i])) {
      *max_ulp = std::max(*max_ulp, UlpDiff(a.master[i], b.master[i]));
    }
    auto cmp16 = [&](const char* field, const Buf& x, const Buf& y) {
      if (x.Bits(i) != y.Bits(i) && !(x.IsNan(i) && y.IsNan(i)))
        report(field, i, x.Get(i), y.Get(i));
    };
    cmp16("exp_avg", a.exp_avg, b.exp_avg);
    cmp16("exp_avg_sq", a.exp_avg_sq, b.exp_avg_sq);
    if (a.combo.has_param) cmp16("param", a.param, b.param);
  }
  return bad;
}

// ------------------------------------------------------------------------------------------------
// Reference 1: PyTorch's AdamW in fp32, transcribed from ATen (see adamw.h), element by element.
// Scalars as Python computes them (double) cast to float as ATen does.

struct TorchScalars {
  float decay, w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, grad_scale;
  bool scale_grad;
  explicit TorchScalars(const AdamWHyper& h) {
    decay = static_cast<float>(1.0 - h.lr * h.weight_decay);  // param.mul_(1 - lr * wd)
    w = static_cast<float>(1.0 - h.beta1);                    // exp_avg.lerp_(grad, 1 - beta1)
    beta2 = static_cast<float>(h.beta2);                      // exp_avg_sq.mul_(beta2)
    one_minus_beta2 = static_cast<float>(1.0 - h.beta2);      // .addcmul_(g, g, value=1-beta2)
    const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
    bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    eps = static_cast<float>(h.eps);
    neg_step_size = static_cast<float>(-(h.lr / bc1));  // addcdiv_(.., value=-step_size)
    grad_scale = h.grad_scale;
    scale_grad = h.grad_scale != 1.0f;
  }
};

void TorchF32Step(Problem& pr, const AdamWHyper& h) {
  const TorchScalars s(h);
  for (size_t i = 0; i < pr.n; ++i) {
    float g = pr.grad.Get(i);
    if (s.scale_grad) g = g * s.grad_scale;
    float p = pr.master[i];
    float m = pr.exp_avg.Get(i);
    float v = pr.exp_avg_sq.Get(i);
    p = p * s.decay;
    // ATen lerp (vectorised): fmadd(w < 0.5 ? w : w - 1, end - self, w < 0.5 ? self : end).
    if (std::fabs(s.w) < 0.5f) {
      m = std::fma(s.w, g - m, m);
    } else {
      m = std::fma(s.w - 1.0f, g - m, g);
    }
    v = std::fma(s.one_minus_beta2 * g, g, v * s.beta2);  // self + (value * t1) * t2, fused
    const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
    p = p + (s.neg_step_size * m) / denom;  // addcdiv: self + (value * t1) / t2
    pr.master[i] = p;
    if (pr.combo.moment == DType::kF32) {
      pr.exp_avg.Set(i, m);
      pr.exp_avg_sq.Set(i, v);
    } else {
      const uint64_t index = static_cast<uint64_t>(pr.sr_offset) + i;
      pr.exp_avg.SetBits(i, F32ToBf16Sr(m, SrHash(pr.sr_seed, index, kSrStreamExpAvg)));
      pr.exp_avg_sq.SetBits(i, F32ToBf16Sr(v, SrHash(pr.sr_seed, index, kSrStreamExpAvgSq)));
    }
    if (pr.combo.has_param) pr.param.Set(i, p);  // round to nearest even
  }
}

// ------------------------------------------------------------------------------------------------
// Reference 2: the same formula in double, with a running bound on how far fp32 arithmetic can
// drift from it (first order in u = 2^-24; each fp32 operation adds at most u * |its result|):
//   m' = m + w (g - m):       em' = |1-w| em + |w| eg + u (|w| |g - m| + |m'|)
//   v' = b2 v + c2 g^2:       ev' = b2 ev + 2 c2 |g| eg + 2u v'
//   s = sqrt(v'):             es  = ev' / (2 s) (or sqrt(ev') when s = 0) + u s
//   den = s / bc2s + eps:     eden = es / bc2s + u (s / bc2s) + u den
//   q = (nss m') / den:       eq  = |nss| em' / den + |q| eden / den + 2u |q|
//   p' = p decay + q:         ep' = |decay| ep + u |p decay| + eq + u |p'|
// where eg = u |g| when the gradient is scaled (else 0). A kernel value must lie within twice the
// bound (the factor 2 absorbs second-order terms) of the reference value.

struct RefElem {
  double p, m, v;     // reference values
  double ep, em, ev;  // error bounds
};

void RefStep(RefElem& e, double g, const TorchScalars& s) {
  const double w = s.w, b2 = s.beta2, c2 = s.one_minus_beta2, bc2s = s.bc2_sqrt;
  const double nss = s.neg_step_size, decay = s.decay, eps = s.eps;
  double eg = 0;
  if (s.scale_grad) {
    g *= static_cast<double>(s.grad_scale);
    eg = kU * std::fabs(g);
  }
  const double d = g - e.m;
  const double m1 = e.m + w * d;
  const double v1 = b2 * e.v + c2 * g * g;
  const double sq = std::sqrt(v1);
  const double den = sq / bc2s + eps;
  const double q = (nss * m1) / den;
  const double pd = e.p * decay;
  const double p1 = pd + q;
  const double em =
      std::fabs(1 - w) * e.em + std::fabs(w) * eg + kU * (std::fabs(w * d) + std::fabs(m1));
  const double ev = b2 * e.ev + 2 * c2 * std::fabs(g) * eg + 2 * kU * v1;
  const double es = (sq > 0 ? ev / (2 * sq) : std::sqrt(ev)) + kU * sq;
  const double eden = es / bc2s + kU * (sq / bc2s) + kU * den;
  const double eq = std::fabs(nss) * em / den + std::fabs(q) * eden / den + 2 * kU * std::fabs(q);
  const double ep = std::fabs(decay) * e.ep + kU * std::fabs(pd) + eq + kU * std::fabs(p1);
  e = RefElem{p1, m1, v1, ep, em, ev};
}

// bf16 ulp at |x| (the spacing of bf16 numbers around x).
double Bf16Ulp(double x) {
  x = std::fabs(x);
  if (x < 0x1p-126) return 0x1p-133;
  int e;
  std::frexp(x, &e);  // x = f 2^e, f in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

// ------------------------------------------------------------------------------------------------
// Conversion oracles independent of bf16.h.

// Nearest bf16 to x, ties to even, overflow to Inf (as if the exponent were unbounded).
uint16_t OracleBf16Rne(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u;
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const uint32_t lo = mag & 0xFFFF0000u;  // truncation toward zero: a bf16 neighbour
  const uint32_t hi = lo + 0x10000u;      // next bf16 away from zero (Inf past the largest)
  const double ax = std::fabs(static_cast<double>(x));
  const double dlo = ax - static_cast<double>(std::bit_cast<float>(lo));
  const double hv = hi == 0x7F800000u ? 0x1p128 : static_cast<double>(std::bit_cast<float>(hi));
  const double dhi = hv - ax;
  uint32_t r;
  if (dlo < dhi) {
    r = lo;
  } else if (dhi < dlo) {
    r = hi;
  } else {
    r = ((lo >> 16) & 1u) ? hi : lo;
  }
  return static_cast<uint16_t>((sign | r) >> 16);
}

uint16_t OracleF16Rne(float x) { return std::bit_cast<uint16_t>(static_cast<_Float16>(x)); }
float OracleF16ToF32(uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }

// Float bit patterns for conversion tests: a stride over all 2^32 patterns plus edge cases.
std::vector<uint32_t> SamplePatterns() {
  std::vector<uint32_t> out;
  for (uint64_t b = 0; b < (uint64_t{1} << 32); b += 997) out.push_back(static_cast<uint32_t>(b));
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) {
      out.push_back((hi << 16) | lo);
    }
  }
  // fp16 boundaries: around 65504/65520, 2^-14, 2^-24, 2^-25 and their rounding midpoints.
  for (float f : {65504.0f, 65519.996f, 65520.0f, 65536.0f, 0x1p-14f, 0x1p-24f, 0x1p-25f,
                  0x1.8p-25f, 0x1.0p-26f, 0x1.ffcp-15f, 0x1.ffep-15f}) {
    const uint32_t b = std::bit_cast<uint32_t>(f);
    for (int d = -3; d <= 3; ++d) {
      out.push_back(b + d);
      out.push_back((b + d) | 0x80000000u);
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------
// Conversion tests (scalar functions of bf16.h).

TEST(Bf16Conversions, RoundToNearestEvenMatchesOracle) {
  size_t bad = 0;
  for (uint32_t b : SamplePatterns()) {
    const float x = std::bit_cast<float>(b);
    const uint16_t got = F32ToBf16Rne(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(Bf16ToF32(got))) << std::hex << b;
      EXPECT_EQ(got, static_cast<uint16_t>((b >> 16) | 0x40)) << std::hex << b;
      continue;
    }
    if (got != OracleBf16Rne(x) && ++bad <= 5) {
      ADD_FAILURE() << std::hex << "x=0x" << b << " got 0x" << got << " want 0x"
                    << OracleBf16Rne(x);
    }
  }
  EXPECT_EQ(bad, 0u);
  EXPECT_EQ(F32ToBf16Rne(kInf), 0x7F80);
  EXPECT_EQ(F32ToBf16Rne(-kInf), 0xFF80);
  EXPECT_EQ(F32ToBf16Rne(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to Inf
  EXPECT_EQ(F32ToBf16Rne(std::bit_cast<float>(0x00000001u)), 0x0000);  // min subnormal -> 0
  EXPECT_EQ(F32ToBf16Rne(std::bit_cast<float>(0x00018000u)), 0x0002);  // subnormal tie -> even
  EXPECT_EQ(F32ToBf16Rne(std::bit_cast<float>(0x7F800001u)), 0x7FC0);  // sNaN -> qNaN, not Inf
  EXPECT_EQ(F32ToBf16Rne(std::bit_cast<float>(0xFFFFFFFFu)), 0xFFFF);  // no wrap-around
  for (uint32_t h = 0; h < 0x10000u; ++h) {  // bf16 -> f32 -> bf16 round trip
    const float x = Bf16ToF32(static_cast<uint16_t>(h));
    EXPECT_EQ(std::bit_cast<uint32_t>(x), h << 16);
    if (!std::isnan(x)) {
      EXPECT_EQ(F32ToBf16Rne(x), h);
    }
  }
}

TEST(Bf16Conversions, Fp16MatchesCompilerFloat16) {
  size_t bad = 0;
  for (uint32_t b : SamplePatterns()) {
    const float x = std::bit_cast<float>(b);
    const uint16_t got = F32ToF16Rne(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(F16ToF32(got))) << std::hex << b;
      continue;
    }
    if (got != OracleF16Rne(x) && ++bad <= 5) {
      ADD_FAILURE() << std::hex << "x=0x" << b << " got 0x" << got << " want 0x" << OracleF16Rne(x);
    }
  }
  EXPECT_EQ(bad, 0u);
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float got = F16ToF32(static_cast<uint16_t>(h));
    const float want = OracleF16ToF32(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << h;
    } else {
      EXPECT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(want)) << std::hex << h;
      EXPECT_EQ(F32ToF16Rne(got), h) << std::hex << h;  // round trip
    }
  }
}

TEST(Bf16Conversions, StochasticRoundingGivesANeighbourAndKeepsInfNan) {
  std::mt19937_64 rng(7);
  for (int k = 0; k < 200000; ++k) {
    const uint32_t b = static_cast<uint32_t>(rng());
    const float x = std::bit_cast<float>(b);
    const uint16_t r = F32ToBf16Sr(x, static_cast<uint32_t>(rng()));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(Bf16ToF32(r)));
      continue;
    }
    const uint16_t down = static_cast<uint16_t>(b >> 16);  // truncation (toward zero)
    EXPECT_TRUE(r == down || r == static_cast<uint16_t>(down + 1)) << std::hex << b;
    if ((b & 0xFFFFu) == 0) {
      EXPECT_EQ(r, down) << "representable values are unchanged";
    }
  }
  for (uint32_t rnd : {0u, 1u, 0x7FFFu, 0x8000u, 0xFFFFu, 0xFFFFFFFFu}) {
    EXPECT_EQ(F32ToBf16Sr(kInf, rnd), 0x7F80);
    EXPECT_EQ(F32ToBf16Sr(-kInf, rnd), 0xFF80);
    EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16Sr(std::bit_cast<float>(0x7F800001u), rnd))));
    EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16Sr(std::bit_cast<float>(0xFFFFFFFFu), rnd))));
    EXPECT_TRUE(std::isnan(Bf16ToF32(F32ToBf16Sr(kNaN, rnd))));
  }
}

// Mean of SR(x) over N samples: each sample is one of the two neighbours lo < x < hi, so the
// standard deviation of one sample is at most (hi - lo) / 2 and that of the mean of N independent
// samples at most (hi - lo) / (2 sqrt(N)). The test asserts |mean - x| <= 5 of those.
TEST(Bf16Conversions, StochasticRoundingIsUnbiased) {
  constexpr int kN = 1000000;
  const float x = 1.0f + 0.3f * 0x1p-7f;  // 30% of the way from 1 to the next bf16 (1 + 2^-7)
  const double lo = 1.0, hi = 1.0 + 0x1p-7;
  const double sigma = (hi - lo) / (2.0 * std::sqrt(static_cast<double>(kN)));
  double sum = 0;
  int up = 0;
  for (int i = 0; i < kN; ++i) {
    const double r = Bf16ToF32(F32ToBf16Sr(x, SrHash(42, 1000 + i, kSrStreamExpAvg)));
    ASSERT_TRUE(r == lo || r == hi);
    up += r == hi;
    sum += r;
  }
  EXPECT_NEAR(sum / kN, x, 5 * sigma) << "up fraction " << static_cast<double>(up) / kN;
  // Round-to-nearest is biased for this x by 0.3 ulp, far more than 5 sigma.
  EXPECT_GT(std::fabs(Bf16ToF32(F32ToBf16Rne(x)) - x), 5 * sigma);
}

TEST(SrHash, DependsOnSeedIndexAndStream) {
  EXPECT_NE(SrHash(1, 5, 0), SrHash(2, 5, 0));
  EXPECT_NE(SrHash(1, 5, 0), SrHash(1, 6, 0));
  EXPECT_NE(SrHash(1, 5, 0), SrHash(1, 5, 1));
  EXPECT_NE(SrHash(1, 5, 0), SrHash(1, 5 + (uint64_t{1} << 32), 0));
  static_assert(SrHash(1, 2, 0) == SrMix(SrKey(1, 0, 0), 2));
  // Low 16 bits roughly uniform: chi-square over 16 buckets of the top 4 of those bits.
  std::vector<int> bucket(16, 0);
  constexpr int kN = 1 << 20;
  for (int i = 0; i < kN; ++i) ++bucket[(SrHash(9, i, 1) >> 12) & 15];
  double chi2 = 0;
  for (int c : bucket) chi2 += (c - kN / 16.0) * (c - kN / 16.0) / (kN / 16.0);
  EXPECT_LT(chi2, 50.0);  // 15 degrees of freedom; p(chi2 > 50) < 1e-5
}

// ------------------------------------------------------------------------------------------------
// Dispatch.

TEST(Dispatch, NamesSupportAndOverride) {
  EXPECT_STREQ(IsaName(Isa::kScalar), "scalar");
  EXPECT_STREQ(IsaName(Isa::kAvx2), "avx2");
  EXPECT_STREQ(IsaName(Isa::kAvx512), "avx512");
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  EXPECT_TRUE(IsaSupported(BestIsa()));
  if (IsaSupported(Isa::kAvx512)) {
    EXPECT_TRUE(IsaSupported(Isa::kAvx2));
  }
  const Isa best = detail::ResolveIsa(nullptr);
  EXPECT_TRUE(IsaSupported(best));
  if (IsaSupported(Isa::kAvx512)) {
    EXPECT_EQ(best, Isa::kAvx512);
  }
  EXPECT_EQ(detail::ResolveIsa("scalar"), Isa::kScalar);
  EXPECT_EQ(detail::ResolveIsa("avx2"), IsaSupported(Isa::kAvx2) ? Isa::kAvx2 : best);
  EXPECT_EQ(detail::ResolveIsa("avx512"), IsaSupported(Isa::kAvx512) ? Isa::kAvx512 : best);
  EXPECT_EQ(detail::ResolveIsa("sse9"), best);
  EXPECT_EQ(detail::ResolveIsa(""), best);
  const char* env = std::getenv("TSD_KERNEL_ISA");
  EXPECT_EQ(BestIsa(), detail::ResolveIsa(env));
}

TEST(Dispatch, CoefficientsFollowPython) {
  AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 3, 1.0f};
  const detail::AdamWCoeffs c = detail::MakeAdamWCoeffs(h);
  EXPECT_EQ(c.decay, static_cast<float>(1 - 1e-3 * 0.01));
  EXPECT_EQ(c.lerp_weight, static_cast<float>(1 - 0.9));
  EXPECT_TRUE(c.lerp_small);
  EXPECT_EQ(c.one_minus_beta2, static_cast<float>(1 - 0.999));
  EXPECT_EQ(c.neg_step_size, static_cast<float>(-(1e-3 / (1 - std::pow(0.9, 3.0)))));
  EXPECT_EQ(c.bc2_sqrt, static_cast<float>(std::sqrt(1 - std::pow(0.999, 3.0))));
  EXPECT_FALSE(c.scale_grad);
  h.beta1 = 0.5;  // weight 0.5 is not "small": torch uses end - (end - self) * (1 - weight)
  EXPECT_FALSE(detail::MakeAdamWCoeffs(h).lerp_small);
  EXPECT_EQ(detail::MakeAdamWCoeffs(h).lerp_coef, -0.5f);
}

// ------------------------------------------------------------------------------------------------
// Kernel tests, for every ISA (unsupported ones are skipped).

class AdamWIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!IsaSupported(GetParam())) {
      GTEST_SKIP() << "this CPU does not support the " << IsaName(GetParam()) << " path";
    }
  }
  Isa isa() const { return GetParam(); }
};

// Bit-exact against the fp32 transcription of PyTorch, for every dtype combination, both lerp
// branches, scaled and unscaled gradients, tails of every length class, 3 consecutive steps.
TEST_P(AdamWIsaTest, MatchesTorchFp32FormulaBitExact) {
  for (size_t n : {1u, 15u, 17u, 33u, 1003u}) {
    for (const Combo& combo : AllCombos()) {
      for (double beta1 : {0.9, 0.3}) {
        for (float grad_scale : {1.0f, 0.37f}) {
          Problem kern(combo, n);
          FillRandom(kern, n * 31 + 7, /*random_state=*/true);
          kern.sr_offset = 12345;
          Problem ref = kern;
          for (int s = 0; s < 3; ++s) {
            const AdamWHyper h{1e-3 * (1 + s), beta1, 0.999, 1e-8, 0.01, 7 + s, grad_scale};
            AdamWStep(kern.Tensors(), h, isa());
            TorchF32Step(ref, h);
            SetGrads(kern, 100 + s, 0.5f);
            SetGrads(ref, 100 + s, 0.5f);
          }
          const std::string what = combo.Name() + " n=" + std::to_string(n) +
                                   " beta1=" + std::to_string(beta1) +
                                   " grad_scale=" + std::to_string(grad_scale);
          EXPECT_EQ(CompareOutputs(kern, ref, what), 0u) << what;
        }
      }
    }
  }
}

// Against the double reference over many steps with a changing lr. fp32 moments: independent
// trajectories, checked against the running bound of RefStep. bf16 moments: the reference restarts
// each step from the kernel's stored state (stochastic rounding makes trajectories diverge by
// design); master must be within the bound and each stored moment within the bound plus one bf16
// ulp (stochastic rounding picks one of the two neighbours).
TEST_P(AdamWIsaTest, MatchesDoubleReferenceMultiStep) {
  for (size_t n : {1u, 15u, 17u, 4099u, 1000003u}) {
    const int steps = n > 100000 ? 4 : 20;
    // The same data for every combination: initial master and the gradients of each step.
    const std::vector<float> p0 = Normal(n, 1000 + n, 1.0f);
    std::vector<std::vector<float>> grads;
    for (int s = 1; s <= steps; ++s) grads.push_back(Normal(n, 7 * s + n, s % 2 ? 0.5f : 2.0f));
    for (const Combo& combo : AllCombos()) {
      const std::string what = combo.Name() + " n=" + std::to_string(n);
      SCOPED_TRACE(what);
      Problem pr(combo, n);
      pr.master = p0;
      std::vector<RefElem> ref(n);
      for (size_t i = 0; i < n; ++i) ref[i] = RefElem{pr.master[i], 0, 0, 0, 0, 0};
      size_t bad = 0;
      double worst = 0;  // largest |error| / bound seen
      auto check = [&](const char* field, size_t i, double got, double want, double bound) {
        const double err = std::fabs(got - want);
        if (bound > 0) worst = std::max(worst, err / bound);
        if (!(err <= bound) && ++bad <= 5) {
          ADD_FAILURE() << field << "[" << i << "] got " << got << " want " << want << " bound "
                        << bound;
        }
      };
      const bool bf16_moments = combo.moment == DType::kBF16;
      for (int s = 1; s <= steps; ++s) {
        const AdamWHyper h{1e-3 * (1.0 + 0.5 * std::sin(s)), 0.9, 0.999, 1e-8, 0.01, s,
                           s % 3 == 0 ? 0.5f : 1.0f};
        const TorchScalars ts(h);
        for (size_t i = 0; i < n; ++i) pr.grad.Set(i, grads[s - 1][i]);
        if (bf16_moments) {
          for (size_t i = 0; i < n; ++i) {
            ref[i] = RefElem{pr.master[i], pr.exp_avg.Get(i), pr.exp_avg_sq.Get(i), 0, 0, 0};
          }
        }
        for (size_t i = 0; i < n; ++i) RefStep(ref[i], pr.grad.Get(i), ts);
        AdamWStep(pr.Tensors(), h, isa());
        for (size_t i = 0; i < n; ++i) {
          const RefElem& r = ref[i];
          const double m = pr.exp_avg.Get(i), v = pr.exp_avg_sq.Get(i);
          check("master", i, pr.master[i], r.p, 2 * r.ep);
          check("exp_avg", i, m, r.m,
                2 * r.em + (bf16_moments ? Bf16Ulp(std::max(std::fabs(r.m), std::fabs(m))) : 0));
          check("exp_avg_sq", i, v, r.v, 2 * r.ev + (bf16_moments ? Bf16Ulp(std::max(r.v, v)) : 0));
          if (combo.has_param && pr.param.Bits(i) != RoundedBits(combo.param, pr.master[i]) &&
              ++bad <= 5) {
            ADD_FAILURE() << "param[" << i << "] is not master rounded to nearest even";
          }
        }
      }
      EXPECT_EQ(bad, 0u) << what << " (worst error/bound " << worst << ")";
      EXPECT_LE(worst, 1.0);
      if (std::getenv("TSD_TEST_VERBOSE")) std::printf("%s worst %.3g\n", what.c_str(), worst);
    }
  }
}

// Edge values in gradients, master and moments. Checked bit for bit against the scalar path and
// the fp32 transcription, plus what IEEE arithmetic of the formula implies.
TEST_P(AdamWIsaTest, EdgeValues) {
  const float denorm = std::bit_cast<float>(0x00000345u);
  const std::vector<float> grads = {
      0.0f,     -0.0f,  denorm, -std::numeric_limits<float>::denorm_min(),
      1e30f,    -1e30f, kNaN,   -kNaN,
      kInf,     -kInf,  1.0f,   -3.0f,
      65504.0f, 3e38f,  1e-8f,  0.5f,
      0.0f};
  const std::vector<float> masters = {0.0f,           -0.0f,          denorm,   1e-39f,  1.0f,
                                      -2.5f,          3e38f,          65520.0f, -1e-30f, 7.0f,
                                      1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 0.1f};
  const std::vector<float> moments = {0.0f, denorm, 1e-30f, 0.25f, -0.5f, 1e-3f, 0.0f};
  for (const Combo& combo : AllCombos()) {
    const size_t n = 67;  // vector body plus a tail
    Problem pr(combo, n);
    for (size_t i = 0; i < n; ++i) {
      pr.grad.Set(i, grads[i % grads.size()]);
      pr.master[i] = masters[i % masters.size()];
      pr.exp_avg.Set(i, moments[i % moments.size()]);
      pr.exp_avg_sq.Set(i, std::fabs(moments[(i + 3) % moments.size()]));
    }
    Problem scalar = pr, ref = pr;
    const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 1.0f};
    AdamWStep(pr.Tensors(), h, isa());
    AdamWStep(scalar.Tensors(), h, Isa::kScalar);
    TorchF32Step(ref, h);
    EXPECT_EQ(CompareOutputs(pr, scalar, combo.Name() + " vs scalar"), 0u);
    EXPECT_EQ(CompareOutputs(pr, ref, combo.Name() + " vs fp32 formula"), 0u);

    const float decay = static_cast<float>(1 - 1e-3 * 0.01);
    for (size_t i = 0; i < n; ++i) {
      const float g = scalar.grad.Get(i);  // the gradient as stored in its dtype
      const float p0 = masters[i % masters.size()];
      if (std::isnan(g)) {
        EXPECT_TRUE(std::isnan(pr.master[i])) << i;
        EXPECT_TRUE(pr.exp_avg.IsNan(i)) << i;
        EXPECT_TRUE(pr.exp_avg_sq.IsNan(i)) << i;
        if (combo.has_param) {
          EXPECT_TRUE(pr.param.IsNan(i)) << i;
        }
      } else if (std::isinf(g)) {
        EXPECT_EQ(pr.exp_avg.Get(i), g) << i;        // m + w (Inf - m) = Inf
        EXPECT_EQ(pr.exp_avg_sq.Get(i), kInf) << i;  // Inf stays Inf through SR
        EXPECT_TRUE(std::isnan(pr.master[i])) << i;  // Inf / Inf
      } else if (std::fabs(g) >= 1e30f) {
        // g^2 overflows: v = Inf, the update (c m) / Inf is -0 or +0, so p = p * decay exactly.
        EXPECT_EQ(pr.exp_avg_sq.Get(i), kInf) << i;
        EXPECT_EQ(pr.master[i], p0 * decay) << i;
      } else if (g == 0.0f && moments[i % moments.size()] == 0.0f) {
        EXPECT_EQ(pr.master[i], p0 * decay) << i;  // zero moment: no update besides decay
      }
      if (std::isfinite(g) && std::isfinite(p0) && std::fabs(g) < 1e30f) {
        EXPECT_TRUE(std::isfinite(pr.master[i])) << i;
      }
    }
  }
}

// Every path, many elements: bit-identical to the scalar path (bound: 0 ulp). Also with the
// AVX-512 bf16 conversion done by the AVX512_BF16 instruction and by integer code.
TEST_P(AdamWIsaTest, AgreesWithScalarPathBitExact) {
  const bool had_insn = detail::Avx512UseBf16Insn();
  for (bool insn : {true, false}) {
    detail::SetAvx512UseBf16Insn(insn);
    for (const Combo& combo : AllCombos()) {
      Problem pr(combo, 100003);
      FillRandom(pr, 99, /*random_state=*/true);
      pr.sr_offset = 777;
      Problem scalar = pr;
      for (int s = 1; s <= 3; ++s) {
        const AdamWHyper h{2e-3, s == 2 ? 0.2 : 0.9, 0.99, 1e-6, 0.1, 10 + s, 1.0f};
        AdamWStep(pr.Tensors(), h, isa());
        AdamWStep(scalar.Tensors(), h, Isa::kScalar);
      }
      int64_t max_ulp = 0;
      EXPECT_EQ(CompareOutputs(pr, scalar, combo.Name(), &max_ulp), 0u);
      EXPECT_EQ(max_ulp, 0) << combo.Name() << ": stated bound is 0 ulp";
    }
  }
  detail::SetAvx512UseBf16Insn(had_insn);
}

// The working parameter's output is written with non-temporal stores where its buffer is aligned
// (64 bytes for fp32, 32 for fp16/bf16) and with ordinary ones where it is not: both give the
// scalar path's bits, tail included, and leave the bytes around the output alone.
TEST_P(AdamWIsaTest, ParamOutputAlignedOrNotBitExact) {
  constexpr size_t kN = 4099;  // whole vectors and a tail of 3
  for (const Combo& combo : AllCombos()) {
    if (!combo.has_param) continue;
    const size_t es = DTypeSize(combo.param);
    Problem scalar(combo, kN);
    FillRandom(scalar, 21, /*random_state=*/true);
    const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 3, 1.0f};
    Problem ref = scalar;
    AdamWStep(ref.Tensors(), h, Isa::kScalar);
    for (size_t offset :
         {size_t{0}, size_t{1}, size_t{16 / es}}) {  // aligned, one element off, 16 bytes off
      const size_t bytes = (kN + 64) * es;
      auto* raw = static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      ASSERT_NE(raw, nullptr);
      std::memset(raw, 0xA5, bytes);
      Problem pr = scalar;
      AdamWTensors t = pr.Tensors();
      t.param_out = raw + offset * es;
      AdamWStep(t, h, isa());
      const std::string what = combo.Name() + " offset " + std::to_string(offset);
      EXPECT_EQ(std::memcmp(raw + offset * es, ref.param.data(), kN * es), 0) << what;
      for (size_t i = 0; i < offset * es; ++i) ASSERT_EQ(raw[i], 0xA5) << what << " byte " << i;
      for (size_t i = (offset + kN) * es; i < bytes; ++i) ASSERT_EQ(raw[i], 0xA5) << what;
      std::free(raw);
    }
  }
}

// The param copy is master rounded to nearest even, for all kinds of values (subnormals, ties,
// overflow, NaN, Inf): lr = wd = 0 and zero moments leave master unchanged.
TEST_P(AdamWIsaTest, ParamOutputConversions) {
  const std::vector<uint32_t> patterns = SamplePatterns();
  const bool had_insn = detail::Avx512UseBf16Insn();
  for (bool insn : {true, false}) {
    detail::SetAvx512UseBf16Insn(insn);
    for (DType pd : {DType::kF32, DType::kBF16, DType::kF16}) {
      // Take every 7th sample to keep the run short, but all of the edge cases at the end.
      std::vector<uint32_t> sel;
      for (size_t k = 0; k < patterns.size(); ++k) {
        if (k % 7 == 0 || k + 100 >= patterns.size()) sel.push_back(patterns[k]);
      }
      Problem pr(Combo{DType::kF32, DType::kF32, true, pd}, sel.size());
      for (size_t i = 0; i < sel.size(); ++i) pr.master[i] = std::bit_cast<float>(sel[i]);
      const AdamWHyper h{0.0, 0.9, 0.999, 1e-8, 0.0, 1, 1.0f};
      AdamWStep(pr.Tensors(), h, isa());
      size_t bad = 0;
      for (size_t i = 0; i < pr.n; ++i) {
        const float x = std::bit_cast<float>(sel[i]);
        if (std::isnan(x)) {
          if (!std::isnan(pr.master[i]) || !pr.param.IsNan(i)) ++bad;
          continue;
        }
        if (std::bit_cast<uint32_t>(pr.master[i]) != sel[i]) ++bad;
        uint32_t want = sel[i];
        if (pd == DType::kBF16) want = OracleBf16Rne(x);
        if (pd == DType::kF16) want = OracleF16Rne(x);
        if (pr.param.Bits(i) != want && ++bad <= 5) {
          ADD_FAILURE() << DTypeName(pd) << " x=0x" << std::hex << sel[i] << " got 0x"
                        << pr.param.Bits(i) << " want 0x" << want;
        }
      }
      // NaN payloads too: exactly what the scalar conversion gives.
      Problem scalar(pr.combo, pr.n);
      for (size_t i = 0; i < sel.size(); ++i) scalar.master[i] = std::bit_cast<float>(sel[i]);
      AdamWStep(scalar.Tensors(), h, Isa::kScalar);
      EXPECT_EQ(CompareOutputs(pr, scalar, std::string("param ") + DTypeName(pd)), 0u);
      EXPECT_EQ(bad, 0u) << DTypeName(pd) << " insn=" << insn;
    }
  }
  detail::SetAvx512UseBf16Insn(had_insn);
}

// Stochastic rounding inside the kernel: beta1 = 0 makes exp_avg = g exactly before rounding, so
// a constant fp32 gradient x shows the rounding of x at 1e6 different indices (bound as in
// Bf16Conversions.StochasticRoundingIsUnbiased: 5 sigma, sigma <= ulp / (2 sqrt(N))).
TEST_P(AdamWIsaTest, StochasticRoundingUnbiasedAndIsaIndependent) {
  constexpr size_t kN = 1000000;
  const float x = 3.0f + 0.7f * 0x1p-6f;  // bf16 spacing at 3 is 2^-6; 70% of the way up
  const double lo = 3.0, hi = 3.0 + 0x1p-6;
  Problem pr(Combo{DType::kF32, DType::kBF16, true, DType::kBF16}, kN);
  for (size_t i = 0; i < kN; ++i) {
    pr.grad.Set(i, x);
    pr.master[i] = 1.0f;
  }
  pr.sr_offset = 5;
  Problem scalar = pr;
  const AdamWHyper h{1e-3, 0.0, 0.999, 1e-8, 0.0, 1, 1.0f};
  AdamWStep(pr.Tensors(), h, isa());
  AdamWStep(scalar.Tensors(), h, Isa::kScalar);
  double sum = 0;
  size_t not_neighbour = 0;
  for (size_t i = 0; i < kN; ++i) {
    const double r = pr.exp_avg.Get(i);
    not_neighbour += !(r == lo || r == hi);
    sum += r;
  }
  EXPECT_EQ(not_neighbour, 0u);
  const double sigma = (hi - lo) / (2.0 * std::sqrt(static_cast<double>(kN)));
  EXPECT_NEAR(sum / kN, x, 5 * sigma);
  EXPECT_GT(std::fabs(Bf16ToF32(F32ToBf16Rne(x)) - x), 5 * sigma);  // RNE would be biased
  EXPECT_EQ(CompareOutputs(pr, scalar, "SR vs scalar"), 0u);
}

// Splitting a range into two calls (with sr_offset) gives the same bits as one call, also when
// the bucket index crosses a 2^32 boundary inside the range.
TEST_P(AdamWIsaTest, SplitRangeBitIdentical) {
  for (int64_t base : {int64_t{0}, int64_t{3}, (int64_t{1} << 32) - 37}) {
    for (const Combo& combo : {Combo{DType::kBF16, DType::kBF16, true, DType::kBF16},
                               Combo{DType::kF16, DType::kBF16, false, DType::kF32},
                               Combo{DType::kF32, DType::kF32, true, DType::kF16}}) {
      const size_t n = 10007;
      Problem whole(combo, n);
      FillRandom(whole, 5, /*random_state=*/true);
      whole.sr_offset = base;
      Problem ref = whole;
      const AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.01, 4, 1.0f};
      AdamWStep(whole.Tensors(), h, isa());
      TorchF32Step(ref, h);
      EXPECT_EQ(CompareOutputs(whole, ref, combo.Name() + " one call vs formula"), 0u);
      for (size_t k : {1u, 8u, 13u, 37u, 5000u, 10006u}) {
        Problem split(combo, n);
        FillRandom(split, 5, /*random_state=*/true);
        split.sr_offset = base;
        AdamWTensors a = split.Tensors(), b = split.Tensors();
        a.n = static_cast<int64_t>(k);
        b.grad = static_cast<const char*>(b.grad) + k * DTypeSize(combo.grad);
        b.master += k;
        b.exp_avg = static_cast<char*>(b.exp_avg) + k * DTypeSize(combo.moment);
        b.exp_avg_sq = static_cast<char*>(b.exp_avg_sq) + k * DTypeSize(combo.moment);
        if (b.param_out) b.param_out = static_cast<char*>(b.param_out) + k * DTypeSize(combo.param);
        b.n = static_cast<int64_t>(n - k);
        b.sr_offset = base + static_cast<int64_t>(k);
        AdamWStep(b, h, isa());  // order does not matter
        AdamWStep(a, h, isa());
        EXPECT_EQ(CompareOutputs(split, whole, combo.Name() + " split at " + std::to_string(k)),
                  0u);
      }
    }
  }
}

TEST_P(AdamWIsaTest, AccumulateGradMatchesLoop) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : {1u, 15u, 17u, 65536u, 1000003u}) {
      Buf g(d, n);
      const std::vector<float> vals = Normal(n, n + 1, 3.0f);
      for (size_t i = 0; i < n; ++i) {
        if (d != DType::kF32 && n == 65536u) {
          g.SetBits(i, static_cast<uint32_t>(i));  // every 16-bit pattern, NaNs included
        } else {
          g.Set(i, vals[i]);
        }
      }
      const std::vector<float> init = Normal(n, n + 2, 1.0f);
      for (bool first : {true, false}) {
        std::vector<float> acc = init;
        AccumulateGrad(g.data(), d, acc.data(), static_cast<int64_t>(n), first, isa());
        size_t bad = 0;
        for (size_t i = 0; i < n; ++i) {
          float gi;
          if (d == DType::kF32) {
            gi = std::bit_cast<float>(g.Bits(i));
          } else if (d == DType::kBF16) {
            gi = std::bit_cast<float>(g.Bits(i) << 16);
          } else {
            gi = OracleF16ToF32(static_cast<uint16_t>(g.Bits(i)));
          }
          const float want = first ? gi : init[i] + gi;
          // Bits must match the scalar conversion exactly (NaN payloads too) and the oracle value.
          const float scalar_conv = g.Get(i);
          const float want_bits = first ? scalar_conv : init[i] + scalar_conv;
          if (!(SameOrBothNan(acc[i], want) &&
                std::bit_cast<uint32_t>(acc[i]) == std::bit_cast<uint32_t>(want_bits)) &&
              ++bad <= 5) {
            ADD_FAILURE() << DTypeName(d) << " n=" << n << " first=" << first << " [" << i
                          << "] got 0x" << std::hex << std::bit_cast<uint32_t>(acc[i]) << " want 0x"
                          << std::bit_cast<uint32_t>(want_bits);
          }
        }
        EXPECT_EQ(bad, 0u);
      }
    }
  }
}

TEST_P(AdamWIsaTest, SumSquaresMatchesLoop) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (size_t n : {0u, 1u, 15u, 17u, 33u, 1000003u}) {
      Buf g(d, n);
      const std::vector<float> vals = Normal(n, 3 * n + 1, 2.0f);
      for (size_t i = 0; i < n; ++i) g.Set(i, vals[i]);
      double want = 0;
      for (size_t i = 0; i < n; ++i) want += static_cast<double>(g.Get(i)) * g.Get(i);
      const double got = SumSquares(g.data(), d, static_cast<int64_t>(n), isa());
      // Squares are exact; only the summation order differs: n * 2^-53 relative is ample.
      EXPECT_NEAR(got, want, want * 1e-12) << DTypeName(d) << " n=" << n;
    }
    // Non-finite inputs are visible in the result.
    Buf g(d, 40);
    for (size_t i = 0; i < 40; ++i) g.Set(i, 1.0f);
    g.Set(33, kInf);
    EXPECT_EQ(SumSquares(g.data(), d, 40, isa()), std::numeric_limits<double>::infinity());
    g.Set(17, kNaN);
    EXPECT_TRUE(std::isnan(SumSquares(g.data(), d, 40, isa())));
    // Huge fp32 values do not overflow the double sum.
    if (d == DType::kF32) {
      g.Set(17, 1e30f);
      g.Set(33, 3e38f);
      const double s = SumSquares(g.data(), d, 40, isa());
      EXPECT_TRUE(std::isfinite(s));
      EXPECT_NEAR(s, 1e60 + 9e76, 9e76 * 1e-6);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamWIsaTest,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

}  // namespace
}  // namespace tsd::kernels
