// Benchmark of the CUDA dequantize kernel (kernels/cuda/dequant.h) beside a device-to-device
// cudaMemcpy of the same output size, in the same run. Default: NF4 -> bf16 of 2^30 elements,
// block 64. Bytes moved by the dequantize: codes and absmax read plus the output written; by the
// copy: the output size read plus written. Prints one JSON line with both and the share.
// Before timing it checks the first and last 2^20 elements against the CPU kernels.
#include <cuda_runtime_api.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/quant.h"
#include "kernels/cuda/dequant.h"

namespace {

using tsd::kernels::DType;
using tsd::kernels::QuantKind;

bool Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "dequant_bench: %s: %s\n", what, cudaGetErrorString(err));
  return false;
}

// Median of `iters` timings (ms) of fn() on `stream`; each timing covers kReps back-to-back calls
// (divided by kReps), so one call's launch overhead hides behind the previous kernel.
constexpr int kReps = 5;

template <typename Fn>
float MedianMs(int iters, cudaStream_t stream, Fn fn) {
  std::vector<float> ms;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(start, stream);
    for (int r = 0; r < kReps; ++r) fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t / kReps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"CUDA dequantize bandwidth beside a device-to-device copy (one JSON line)"};
  int64_t n = int64_t{1} << 30;
  int64_t block_size = 64;
  std::string kind_name = "nf4";
  std::string dtype_name = "bf16";
  int iters = 20;
  app.add_option("--elements", n, "elements of the tensor")->check(CLI::PositiveNumber);
  app.add_option("--block-size", block_size, "quantization block size");
  app.add_option("--kind", kind_name, "nf4 or int8");
  app.add_option("--dtype", dtype_name, "output dtype: fp32, bf16 or fp16");
  app.add_option("--iters", iters, "timed repetitions (the median is reported)")
      ->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);

  const absl::StatusOr<QuantKind> kind = tsd::kernels::ParseQuantKind(kind_name);
  if (!kind.ok()) {
    std::fprintf(stderr, "dequant_bench: %s\n", std::string(kind.status().message()).c_str());
    return 2;
  }
  DType dtype;
  if (dtype_name == "fp32") {
    dtype = DType::kF32;
  } else if (dtype_name == "bf16") {
    dtype = DType::kBF16;
  } else if (dtype_name == "fp16") {
    dtype = DType::kF16;
  } else {
    std::fprintf(stderr, "dequant_bench: --dtype %s: use fp32, bf16 or fp16\n", dtype_name.c_str());
    return 2;
  }
  if (const absl::Status s = tsd::kernels::ValidateQuantShape(*kind, n, block_size); !s.ok()) {
    std::fprintf(stderr, "dequant_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "dequant_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);

  // Random codes (every code value) and absmax in [2^-8, 1).
  const int64_t code_bytes = tsd::kernels::QuantCodeBytes(*kind, n);
  const int64_t blocks = tsd::kernels::QuantNumBlocks(n, block_size);
  const size_t out_bytes = static_cast<size_t>(n) * tsd::kernels::DTypeSize(dtype);
  std::vector<uint8_t> codes(static_cast<size_t>(code_bytes));
  std::vector<float> absmax(static_cast<size_t>(blocks));
  std::mt19937_64 rng(42);
  for (size_t i = 0; i + 8 <= codes.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(&codes[i], &r, 8);
  }
  for (size_t i = codes.size() / 8 * 8; i < codes.size(); ++i)
    codes[i] = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> uniform(1.0f / 256, 1.0f);
  for (auto& a : absmax) a = uniform(rng);

  void *d_codes = nullptr, *d_absmax = nullptr, *d_out = nullptr, *d_copy = nullptr;
  if (!Check(cudaMalloc(&d_codes, codes.size()), "cudaMalloc codes") ||
      !Check(cudaMalloc(&d_absmax, absmax.size() * 4), "cudaMalloc absmax") ||
      !Check(cudaMalloc(&d_out, out_bytes), "cudaMalloc output") ||
      !Check(cudaMalloc(&d_copy, out_bytes), "cudaMalloc copy source")) {
    return 1;
  }
  cudaMemcpy(d_codes, codes.data(), codes.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(d_absmax, absmax.data(), absmax.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(d_copy, 0x3C, out_bytes);
  cudaStream_t stream;
  cudaStreamCreate(&stream);

  auto dequant = [&] {
    return tsd::kernels::cuda::DequantizeAsync(*kind, static_cast<const uint8_t*>(d_codes),
                                               static_cast<const float*>(d_absmax), n, block_size,
                                               d_out, dtype, stream);
  };
  if (!Check(dequant(), "dequantize launch") ||
      !Check(cudaStreamSynchronize(stream), "dequantize")) {
    return 1;
  }

  // Correctness of the first and last 2^20 elements (whole blocks) against the CPU kernels.
  bool verified = true;
  const int64_t probe_blocks =
      std::min<int64_t>(blocks, ((int64_t{1} << 20) + block_size - 1) / block_size);
  for (int64_t first_block : {int64_t{0}, blocks - probe_blocks}) {
    const int64_t first = first_block * block_size;
    const int64_t count = std::min(n, (first_block + probe_blocks) * block_size) - first;
    const size_t esize = tsd::kernels::DTypeSize(dtype);
    std::vector<unsigned char> want(static_cast<size_t>(count) * esize), got(want.size());
    const int64_t code_offset = *kind == QuantKind::kNf4 ? first / 2 : first;
    const tsd::kernels::ConstQuantizedView view{
        *kind, block_size, count, codes.data() + code_offset, absmax.data() + first_block};
    if (!tsd::kernels::Dequantize(view, want.data(), dtype).ok()) verified = false;
    cudaMemcpy(got.data(), static_cast<unsigned char*>(d_out) + first * esize, got.size(),
               cudaMemcpyDeviceToHost);
    if (want != got) verified = false;
  }

  for (int i = 0; i < 3; ++i) {  // warm-up
    dequant();
    cudaMemcpyAsync(d_copy, d_out, out_bytes, cudaMemcpyDeviceToDevice, stream);
  }
  if (!Check(cudaStreamSynchronize(stream), "warm-up")) return 1;
  const float dequant_ms = MedianMs(iters, stream, [&] { dequant(); });
  const float copy_ms = MedianMs(iters, stream, [&] {
    cudaMemcpyAsync(d_out, d_copy, out_bytes, cudaMemcpyDeviceToDevice, stream);
  });
  if (!Check(cudaStreamSynchronize(stream), "timed runs")) return 1;

  const double dequant_bytes = static_cast<double>(code_bytes) + static_cast<double>(blocks) * 4.0 +
                               static_cast<double>(out_bytes);
  const double copy_bytes = 2.0 * static_cast<double>(out_bytes);
  const double dequant_gbps = dequant_bytes / (dequant_ms * 1e-3) / 1e9;
  const double copy_gbps = copy_bytes / (copy_ms * 1e-3) / 1e9;
  std::printf(
      "{\"bench\": \"dequant_cuda\", \"kind\": \"%s\", \"dtype\": \"%s\", \"elements\": %lld, "
      "\"block_size\": %lld, \"device\": \"%s\", \"verified\": %s, \"iters\": %d, "
      "\"tsd_ms\": %.4f, \"tsd_bytes\": %.0f, \"tsd_gbps\": %.1f, \"copy_ms\": %.4f, "
      "\"copy_bytes\": %.0f, \"copy_gbps\": %.1f, \"share_of_copy_bandwidth\": %.3f}\n",
      kind_name.c_str(), dtype_name.c_str(), static_cast<long long>(n),
      static_cast<long long>(block_size), prop.name, verified ? "true" : "false", iters, dequant_ms,
      dequant_bytes, dequant_gbps, copy_ms, copy_bytes, copy_gbps, dequant_gbps / copy_gbps);

  cudaFree(d_codes);
  cudaFree(d_absmax);
  cudaFree(d_out);
  cudaFree(d_copy);
  cudaStreamDestroy(stream);
  return verified ? 0 : 3;
}
