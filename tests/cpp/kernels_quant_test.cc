// Tests of the CPU quantize/dequantize kernels (kernels/cpu/quant.h).
//
// What is checked:
//  * Known answers worked out by hand from the format's definition (docs/quantization.md), so the
//    scalar reference itself is checked: NF4 codes and nibble order, odd-count padding, a value
//    exactly on a midpoint (lower code) and the next float above it (upper code), int8 ties to
//    even, zero blocks, negative zero.
//  * Every ISA on this CPU against the scalar path, bit for bit (codes, absmax, and dequantized
//    fp32/bf16/fp16), for random data and edge values: zeros, a whole zero block, -0, values on
//    midpoints and on int8 half-way points, subnormals (also a block whose absmax is so small that
//    1/absmax overflows), the largest finite values of each input dtype, a last partial block,
//    odd counts, block sizes that are and are not multiples of the vector steps.
//  * dequantize(quantize(x)): every code is a nearest code of x/absmax and the error is within
//    half the largest gap between code values (NF4) or half a step (int8), plus rounding.
//  * Splitting a tensor into block ranges gives the same bytes; all 256 code bytes dequantize
//    to the formula's values.
//  * Refusals: Inf and NaN (named element and block, outputs untouched), odd NF4 block sizes,
//    zero/negative sizes, block ranges out of bounds, unknown kinds.
//
// Built with -ffp-contract=off so that the fp32 expressions here round where they say they do.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/bf16.h"
#include "kernels/cpu/quant.h"

namespace tsd::kernels {

void PrintTo(Isa isa, std::ostream* os) { *os << IsaName(isa); }

namespace {

using detail::kNf4Values;
using detail::Nf4Midpoint;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kDenormMin = std::numeric_limits<float>::denorm_min();

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

// A tensor in one dtype, built from fp32 values (rounded to nearest even for 16-bit dtypes).
struct Tensor {
  DType dtype = DType::kF32;
  std::vector<unsigned char> bytes;

  Tensor(DType d, const std::vector<float>& values)
      : dtype(d), bytes(values.size() * DTypeSize(d)) {
    for (size_t i = 0; i < values.size(); ++i) Set(i, values[i]);
  }
  Tensor(DType d, size_t n) : dtype(d), bytes(n * DTypeSize(d)) {}
  size_t size() const { return bytes.size() / DTypeSize(dtype); }
  void Set(size_t i, float v) {
    if (dtype == DType::kF32) {
      std::memcpy(bytes.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBf16Rne(v) : F32ToF16Rne(v);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  float Get(size_t i) const {
    if (dtype == DType::kF32) {
      float v;
      std::memcpy(&v, bytes.data() + 4 * i, 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
  }
};

// The quantized buffers of one tensor.
struct Quantized {
  QuantKind kind;
  int64_t block_size;
  int64_t n;
  std::vector<uint8_t> codes;
  std::vector<float> absmax;

  Quantized(QuantKind k, int64_t bs, int64_t count, uint8_t fill = 0xA5)
      : kind(k),
        block_size(bs),
        n(count),
        codes(static_cast<size_t>(QuantCodeBytes(k, count)), fill),
        absmax(static_cast<size_t>(QuantNumBlocks(count, bs)), -1.0f) {}
  QuantizedView View() { return {kind, block_size, n, codes.data(), absmax.data()}; }
  ConstQuantizedView ConstView() const {
    return {kind, block_size, n, codes.data(), absmax.data()};
  }
};

Quantized QuantizeOk(const Tensor& x, QuantKind kind, int64_t bs, Isa isa) {
  Quantized q(kind, bs, static_cast<int64_t>(x.size()));
  const absl::Status s = Quantize(x.bytes.data(), x.dtype, q.View(), isa);
  EXPECT_TRUE(s.ok()) << s;
  return q;
}

Tensor DequantizeOk(const Quantized& q, DType dtype, Isa isa) {
  Tensor out(dtype, static_cast<size_t>(q.n));
  std::fill(out.bytes.begin(), out.bytes.end(), 0x5A);
  const absl::Status s = Dequantize(q.ConstView(), out.bytes.data(), dtype, isa);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::vector<uint32_t> AbsmaxBits(const Quantized& q) {
  std::vector<uint32_t> bits;
  for (float a : q.absmax) bits.push_back(std::bit_cast<uint32_t>(a));
  return bits;
}

// ------------------------------------------------------------------------------------------------
// Known answers (scalar path, worked out from the definition).

TEST(QuantKnownAnswers, Nf4EvenCount) {
  // absmax 1, reciprocal 1: 1.0 -> 15, -1.0 -> 0, 0.0 -> 7, 0.5 lies between m[11] ~ 0.389 and
  // m[12] ~ 0.5017 -> 12. High nibble first: 0xF0, 0x7C.
  const Tensor x(DType::kF32, {1.0f, -1.0f, 0.0f, 0.5f});
  const Quantized q = QuantizeOk(x, QuantKind::kNf4, 4, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0xF0, 0x7C}));
  EXPECT_EQ(q.absmax, (std::vector<float>{1.0f}));
  const Tensor y = DequantizeOk(q, DType::kF32, Isa::kScalar);
  EXPECT_EQ(y.Get(0), 1.0f);
  EXPECT_EQ(y.Get(1), -1.0f);
  EXPECT_EQ(y.Get(2), 0.0f);
  EXPECT_EQ(y.Get(3), 0.44070982933044434f);
}

TEST(QuantKnownAnswers, Nf4OddCountIsPaddedWithTheCodeOfZero) {
  // absmax 2, reciprocal 0.5: s = 1 -> 15; s = -0.5 lies between m[1] ~ -0.611 and
  // m[2] ~ -0.460 -> 2; s = 0.125 lies between m[8] ~ 0.1203 and m[9] ~ 0.2035 -> 9; pad 7.
  const Tensor x(DType::kF32, {2.0f, -1.0f, 0.25f});
  const Quantized q = QuantizeOk(x, QuantKind::kNf4, 64, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0xF2, 0x97}));
  EXPECT_EQ(q.absmax, (std::vector<float>{2.0f}));
  const Tensor y = DequantizeOk(q, DType::kF32, Isa::kScalar);
  EXPECT_EQ(y.Get(0), 2.0f);
  EXPECT_EQ(y.Get(1), -0.5250730514526367f * 2.0f);
  EXPECT_EQ(y.Get(2), 0.16093020141124725f * 2.0f);
}

TEST(QuantKnownAnswers, Nf4MidpointTakesTheLowerCode) {
  // With absmax 1 (the 1.0 in the block) s == x. x == m[8] exactly -> code 8; the next float
  // above -> 9; -m[8]... and m[3] (negative side) -> 3, just above -> 4.
  const float m8 = Nf4Midpoint(8);
  const float m3 = Nf4Midpoint(3);
  EXPECT_EQ(m8, (0.07958029955625534f + 0.16093020141124725f) / 2.0f);
  const Tensor x(DType::kF32,
                 {1.0f, m8, std::nextafter(m8, 2.0f), m3, std::nextafter(m3, 2.0f), -1.0f});
  const Quantized q = QuantizeOk(x, QuantKind::kNf4, 6, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0xF8, 0x93, 0x40}));
}

TEST(QuantKnownAnswers, Int8RoundsHalfToEven) {
  // absmax 127: scale 127/127 = 1, so q = round_half_even(x).
  const Tensor x(DType::kF32, {127.0f, -63.5f, 0.5f, 1.5f, 2.5f, -0.0f, -2.5f, 100.49f});
  const Quantized q = QuantizeOk(x, QuantKind::kInt8, 8, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{127, static_cast<uint8_t>(-64), 0, 2, 2, 0,
                                           static_cast<uint8_t>(-2), 100}));
  const Tensor y = DequantizeOk(q, DType::kF32, Isa::kScalar);
  const std::vector<float> want = {127, -64, 0, 2, 2, 0, -2, 100};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(y.Get(i), want[i]) << i;
}

TEST(QuantKnownAnswers, Int8ScaleAndDequantizeInFp32) {
  // absmax 254: scale = 0.5. 3 -> 1.5 -> 2; 1 -> 0.5 -> 0; -5 -> -2.5 -> -2; 254 -> 127.
  // Dequantized: q * (254 / 127) = q * 2.
  const Tensor x(DType::kF32, {3.0f, 1.0f, -5.0f, 254.0f});
  const Quantized q = QuantizeOk(x, QuantKind::kInt8, 64, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{2, 0, static_cast<uint8_t>(-2), 127}));
  EXPECT_EQ(q.absmax, (std::vector<float>{254.0f}));
  const Tensor y = DequantizeOk(q, DType::kBF16, Isa::kScalar);
  EXPECT_EQ(y.Get(0), 4.0f);
  EXPECT_EQ(y.Get(1), 0.0f);
  EXPECT_EQ(y.Get(2), -4.0f);
  EXPECT_EQ(y.Get(3), 254.0f);
}

TEST(QuantKnownAnswers, ZeroBlocksAndNegativeZero) {
  // Block 0 all zeros (one of them -0), block 1 a real block: NF4 codes 7 everywhere in block 0,
  // absmax 0; dequantized zeros are +0 (7 is +0.0, times 0).
  const Tensor x(DType::kBF16, {0.0f, -0.0f, 0.0f, 0.0f, -0.0f, 4.0f, 0.0f, -4.0f});
  const Quantized q = QuantizeOk(x, QuantKind::kNf4, 4, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0x77, 0x77, 0x7F, 0x70}));
  EXPECT_EQ(q.absmax, (std::vector<float>{0.0f, 4.0f}));
  const Quantized qi = QuantizeOk(x, QuantKind::kInt8, 4, Isa::kScalar);
  EXPECT_EQ(qi.codes, (std::vector<uint8_t>{0, 0, 0, 0, 0, 127, 0, static_cast<uint8_t>(-127)}));
  const Tensor y = DequantizeOk(qi, DType::kF32, Isa::kScalar);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(std::bit_cast<uint32_t>(y.Get(i)), 0u) << i;
}

TEST(QuantKnownAnswers, TinyAbsmaxWhoseReciprocalOverflows) {
  // absmax = the smallest subnormal: 1/absmax is +Inf in fp32. Zeros still code 0.0, the
  // non-zero values code +-1.
  const Tensor x(DType::kF32, {kDenormMin, 0.0f, -kDenormMin, -0.0f});
  const Quantized q = QuantizeOk(x, QuantKind::kNf4, 4, Isa::kScalar);
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0xF7, 0x07}));
  const Quantized qi = QuantizeOk(x, QuantKind::kInt8, 4, Isa::kScalar);
  EXPECT_EQ(qi.codes, (std::vector<uint8_t>{127, 0, static_cast<uint8_t>(-127), 0}));
}

TEST(QuantKnownAnswers, DequantizeEveryByte) {
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    const int64_t n = kind == QuantKind::kNf4 ? 512 : 256;
    Quantized q(kind, 64, n);
    for (int b = 0; b < 256; ++b) q.codes[static_cast<size_t>(b)] = static_cast<uint8_t>(b);
    for (size_t k = 0; k < q.absmax.size(); ++k) q.absmax[k] = 0.75f + static_cast<float>(k);
    const Tensor y = DequantizeOk(q, DType::kF32, Isa::kScalar);
    for (int64_t i = 0; i < n; ++i) {
      const float a = q.absmax[static_cast<size_t>(i / 64)];
      float want;
      if (kind == QuantKind::kNf4) {
        const uint8_t byte = q.codes[static_cast<size_t>(i / 2)];
        want = kNf4Values[i % 2 == 0 ? byte >> 4 : byte & 15] * a;
      } else {
        want =
            static_cast<float>(static_cast<int8_t>(q.codes[static_cast<size_t>(i)])) * (a / 127.0f);
      }
      EXPECT_EQ(y.Get(static_cast<size_t>(i)), want) << QuantKindName(kind) << " element " << i;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Refusals.

TEST(QuantErrors, NonFiniteInputIsRefusedAndNothingIsWritten) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (float bad : {kNaN, kInf, -kInf}) {
        for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
          std::vector<float> v(300, 0.5f);
          v[130] = bad;
          const Tensor x(dtype, v);
          Quantized q(kind, 64, 300);
          const absl::Status s = Quantize(x.bytes.data(), dtype, q.View(), isa);
          ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << IsaName(isa);
          const std::string msg(s.message());
          EXPECT_NE(msg.find("element 130 (block 2)"), std::string::npos) << msg;
          const char* name = std::isnan(bad) ? "NaN" : (bad > 0 ? "+Inf" : "-Inf");
          EXPECT_NE(msg.find(name), std::string::npos) << msg;
          EXPECT_TRUE(
              std::all_of(q.codes.begin(), q.codes.end(), [](uint8_t c) { return c == 0xA5; }))
              << "codes were written before the error (" << IsaName(isa) << ", " << DTypeName(dtype)
              << ")";
          EXPECT_TRUE(
              std::all_of(q.absmax.begin(), q.absmax.end(), [](float a) { return a == -1.0f; }));
        }
      }
    }
  }
}

TEST(QuantErrors, NonFiniteFoundInEveryPosition) {
  // Vector scans must find a bad value in any lane, the tail included.
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!IsaSupported(isa)) continue;
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (size_t pos = 0; pos < 71; ++pos) {
        std::vector<float> v(71, -3.0f);
        v[pos] = pos % 2 ? kInf : kNaN;
        const Tensor x(dtype, v);
        Quantized q(QuantKind::kInt8, 8, 71);
        const absl::Status s = Quantize(x.bytes.data(), dtype, q.View(), isa);
        ASSERT_FALSE(s.ok());
        EXPECT_NE(std::string(s.message()).find("element " + std::to_string(pos) + " "),
                  std::string::npos)
            << s;
      }
    }
  }
}

TEST(QuantErrors, BadShapesAndArguments) {
  const Tensor x(DType::kF32, std::vector<float>(10, 1.0f));
  Quantized q(QuantKind::kNf4, 4, 10);
  QuantizedView v = q.View();
  v.block_size = 3;
  absl::Status s = Quantize(x.bytes.data(), DType::kF32, v);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message()).find("multiple of 2"), std::string::npos) << s;
  v.block_size = 0;
  s = Quantize(x.bytes.data(), DType::kF32, v);
  EXPECT_NE(std::string(s.message()).find("not positive"), std::string::npos) << s;
  v.block_size = -64;
  EXPECT_FALSE(Quantize(x.bytes.data(), DType::kF32, v).ok());
  v = q.View();
  v.n = -1;
  EXPECT_NE(std::string(Quantize(x.bytes.data(), DType::kF32, v).message()).find("negative"),
            std::string::npos);
  v = q.View();
  v.codes = nullptr;
  EXPECT_FALSE(Quantize(x.bytes.data(), DType::kF32, v).ok());
  EXPECT_FALSE(Quantize(nullptr, DType::kF32, q.View()).ok());
  EXPECT_FALSE(Quantize(x.bytes.data(), static_cast<DType>(9), q.View()).ok());
  v = q.View();
  v.kind = static_cast<QuantKind>(7);
  EXPECT_FALSE(Quantize(x.bytes.data(), DType::kF32, v).ok());
  // Block ranges: 10 elements in blocks of 4 are 3 blocks.
  EXPECT_TRUE(QuantizeBlocks(x.bytes.data(), DType::kF32, q.View(), 1, 3).ok());
  EXPECT_FALSE(QuantizeBlocks(x.bytes.data(), DType::kF32, q.View(), 0, 4).ok());
  EXPECT_FALSE(QuantizeBlocks(x.bytes.data(), DType::kF32, q.View(), 2, 1).ok());
  EXPECT_FALSE(QuantizeBlocks(x.bytes.data(), DType::kF32, q.View(), -1, 1).ok());
  EXPECT_TRUE(QuantizeBlocks(x.bytes.data(), DType::kF32, q.View(), 3, 3).ok());
  Tensor out(DType::kF32, 10);
  EXPECT_FALSE(DequantizeBlocks(q.ConstView(), out.bytes.data(), DType::kF32, 0, 5).ok());
  EXPECT_FALSE(Dequantize(q.ConstView(), nullptr, DType::kF32).ok());
  ConstQuantizedView c = q.ConstView();
  c.block_size = 5;
  EXPECT_FALSE(Dequantize(c, out.bytes.data(), DType::kF32).ok());
  // int8 takes any positive block size.
  Quantized qi(QuantKind::kInt8, 3, 10);
  EXPECT_TRUE(Quantize(x.bytes.data(), DType::kF32, qi.View()).ok());
  // Empty tensors are fine and need no buffers.
  EXPECT_TRUE(
      Quantize(nullptr, DType::kF32, QuantizedView{QuantKind::kNf4, 64, 0, nullptr, nullptr}).ok());
}

TEST(QuantErrors, KindNames) {
  EXPECT_EQ(*ParseQuantKind("nf4"), QuantKind::kNf4);
  EXPECT_EQ(*ParseQuantKind("int8"), QuantKind::kInt8);
  const absl::StatusOr<QuantKind> bad = ParseQuantKind("fp4");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("\"fp4\""), std::string::npos);
  EXPECT_STREQ(QuantKindName(QuantKind::kInt8), "int8");
  EXPECT_EQ(QuantCodeBytes(QuantKind::kNf4, 7), 4);
  EXPECT_EQ(QuantCodeBytes(QuantKind::kInt8, 7), 7);
  EXPECT_EQ(QuantNumBlocks(129, 64), 3);
  EXPECT_EQ(QuantNumBlocks(128, 64), 2);
  EXPECT_EQ(QuantNumBlocks(0, 64), 0);
}

// ------------------------------------------------------------------------------------------------
// Every ISA against the scalar reference.

// Random values (mixed magnitudes) with the edge values of the format and of `dtype` planted.
std::vector<float> EdgeData(int64_t n, int64_t block_size, DType dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> pick(0, 11);
  const float largest = dtype == DType::kF32    ? kFltMax
                        : dtype == DType::kBF16 ? Bf16ToF32(0x7F7F)
                                                : 65504.0f;
  const float smallest = dtype == DType::kF32    ? kDenormMin
                         : dtype == DType::kBF16 ? Bf16ToF32(0x0001)
                                                 : F16ToF32(0x0001);
  std::vector<float> v(static_cast<size_t>(n));
  const int64_t blocks = QuantNumBlocks(n, block_size);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * block_size, end = std::min(n, begin + block_size);
    const int kind = pick(rng);
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    for (int64_t i = begin; i < end; ++i) {
      float x = normal(rng) * scale;
      switch (kind) {
        case 0:  // a whole zero block, with some -0
          x = (i % 3 == 0) ? -0.0f : 0.0f;
          break;
        case 1:  // absmax 1 and values exactly on NF4 midpoints (and their neighbours)
          x = i == begin ? 1.0f : Nf4Midpoint(static_cast<int>(rng() % 15));
          if (rng() % 3 == 0) x = std::nextafter(x, (rng() % 2) ? 2.0f : -2.0f);
          break;
        case 2:  // absmax 127 and int8 half-way points
          x = i == begin ? -127.0f : static_cast<float>(static_cast<int>(rng() % 254) - 127) + 0.5f;
          break;
        case 3:  // subnormals only (1/absmax may overflow)
          x = smallest * static_cast<float>(static_cast<int>(rng() % 9) - 4);
          break;
        case 4:  // the largest finite values
          x = (rng() % 4 == 0) ? largest : -largest * (rng() % 2 ? 1.0f : 0.5f);
          break;
        case 5:  // a mix of zeros, -0 and tiny values in a normal block
          if (rng() % 2) x = (rng() % 2) ? -0.0f : smallest;
          break;
        default:
          break;
      }
      if (std::fabs(x) > largest) x = std::copysign(largest, x);  // stays finite in `dtype`
      v[static_cast<size_t>(i)] = x;
    }
  }
  return v;
}

class QuantIsaTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!IsaSupported(GetParam())) {
      GTEST_SKIP() << "this CPU does not support the " << IsaName(GetParam()) << " path";
    }
  }
  Isa isa() const { return GetParam(); }
};

TEST_P(QuantIsaTest, BitIdenticalToScalar) {
  const std::vector<int64_t> sizes = {0,  1,  2,  3,  15,  16,  17,   31,   32,
                                      33, 63, 64, 65, 127, 129, 1000, 4097, 20011};
  uint32_t seed = 1;
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    std::vector<int64_t> block_sizes = {2, 6, 16, 32, 34, 64, 96, 128, 4096};
    if (kind == QuantKind::kInt8) block_sizes.insert(block_sizes.end(), {1, 7, 33});
    for (DType in_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int64_t bs : block_sizes) {
        for (int64_t n : sizes) {
          const Tensor x(in_dtype, EdgeData(n, bs, in_dtype, seed++));
          const Quantized ref = QuantizeOk(x, kind, bs, Isa::kScalar);
          const Quantized got = QuantizeOk(x, kind, bs, isa());
          const std::string where = std::string(QuantKindName(kind)) +
                                    " in=" + DTypeName(in_dtype) + " bs=" + std::to_string(bs) +
                                    " n=" + std::to_string(n);
          ASSERT_EQ(got.codes, ref.codes) << where;
          ASSERT_EQ(AbsmaxBits(got), AbsmaxBits(ref)) << where;
          for (DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
            const Tensor a = DequantizeOk(ref, out_dtype, Isa::kScalar);
            const Tensor b = DequantizeOk(got, out_dtype, isa());
            ASSERT_EQ(a.bytes, b.bytes) << where << " out=" << DTypeName(out_dtype);
          }
        }
      }
    }
  }
}

TEST_P(QuantIsaTest, DequantizeArbitraryBytesBitIdentical) {
  // Codes and absmax not produced by Quantize (a checkpoint's): every byte value, absmax of any
  // magnitude including subnormal, huge (products overflow to Inf) and zero.
  std::mt19937 rng(7);
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    for (int64_t bs : {2, 18, 64, 256}) {
      for (int64_t n : {1, 5, 64, 333, 5000}) {
        Quantized q(kind, bs, n);
        for (auto& c : q.codes) c = static_cast<uint8_t>(rng());
        for (auto& a : q.absmax) {
          switch (rng() % 5) {
            case 0:
              a = 0.0f;
              break;
            case 1:
              a = kDenormMin * static_cast<float>(rng() % 1000);
              break;
            case 2:
              a = kFltMax;
              break;
            default:
              a = std::ldexp(static_cast<float>(rng() % 100000) / 1e5f,
                             static_cast<int>(rng() % 60) - 30);
          }
        }
        for (DType out_dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
          const Tensor a = DequantizeOk(q, out_dtype, Isa::kScalar);
          const Tensor b = DequantizeOk(q, out_dtype, isa());
          ASSERT_EQ(a.bytes, b.bytes) << QuantKindName(kind) << " bs=" << bs << " n=" << n
                                      << " out=" << DTypeName(out_dtype);
        }
      }
    }
  }
}

TEST_P(QuantIsaTest, BlockRangesGiveTheSameBytes) {
  const int64_t n = 64 * 37 + 21, bs = 64;
  const Tensor x(DType::kBF16, EdgeData(n, bs, DType::kBF16, 99));
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    const Quantized whole = QuantizeOk(x, kind, bs, isa());
    Quantized pieces(kind, bs, n);
    const int64_t blocks = QuantNumBlocks(n, bs);
    for (int64_t b = 0; b < blocks;) {
      const int64_t e = std::min(blocks, b + 1 + b % 5);
      ASSERT_TRUE(QuantizeBlocks(x.bytes.data(), x.dtype, pieces.View(), b, e, isa()).ok());
      b = e;
    }
    EXPECT_EQ(pieces.codes, whole.codes);
    EXPECT_EQ(AbsmaxBits(pieces), AbsmaxBits(whole));
    const Tensor full = DequantizeOk(whole, DType::kF16, isa());
    Tensor parts(DType::kF16, static_cast<size_t>(n));
    for (int64_t b = 0; b < blocks; b += 3) {
      ASSERT_TRUE(DequantizeBlocks(whole.ConstView(), parts.bytes.data(), DType::kF16, b,
                                   std::min(blocks, b + 3), isa())
                      .ok());
    }
    EXPECT_EQ(parts.bytes, full.bytes);
  }
}

TEST_P(QuantIsaTest, RoundTripErrorBounds) {
  // Largest half-gap between adjacent NF4 code values (between 0.7230 and 1.0: ~0.1385).
  double nf4_half_gap = 0;
  for (int k = 0; k < 15; ++k) {
    nf4_half_gap = std::max(nf4_half_gap, (double{kNf4Values[k + 1]} - kNf4Values[k]) / 2);
  }
  const double u = 0x1p-24;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  const int64_t n = 64 * 500 + 17, bs = 64;
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = normal(rng);
  const Tensor x(DType::kF32, v);
  for (QuantKind kind : {QuantKind::kNf4, QuantKind::kInt8}) {
    const Quantized q = QuantizeOk(x, kind, bs, isa());
    const Tensor y = DequantizeOk(q, DType::kF32, isa());
    for (int64_t i = 0; i < n; ++i) {
      const double a = q.absmax[static_cast<size_t>(i / bs)];
      const double xi = v[static_cast<size_t>(i)];
      const double err = std::fabs(y.Get(static_cast<size_t>(i)) - xi);
      if (kind == QuantKind::kNf4) {
        ASSERT_LE(err, nf4_half_gap * a + 4 * u * a) << i;
        // The chosen code is a nearest code of x / absmax (within fp32 rounding of the scaling).
        const uint8_t byte = q.codes[static_cast<size_t>(i / 2)];
        const int code = i % 2 == 0 ? byte >> 4 : byte & 15;
        const double s = xi / a;
        for (int j = 0; j < 16; ++j) {
          ASSERT_LE(std::fabs(s - kNf4Values[code]), std::fabs(s - kNf4Values[j]) + 4 * u)
              << "element " << i << " code " << code << " but " << j << " is nearer";
        }
      } else {
        ASSERT_LE(err, 0.5 * a / 127 + 4 * u * a) << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, QuantIsaTest,
                         ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& info) {
                           return std::string(IsaName(info.param));
                         });

}  // namespace
}  // namespace tsd::kernels
