// optimizer_bench: the optimizer engine of a running tsd, measured from a client.
//
//   optimizer_bench --socket PATH [--params N] [--buckets B] [--steps S] [--threads T]
//
// Prints one JSON object per line:
//   {"bench":"stream", ...}        host memory bandwidth (copy and triad, T threads): the bound
//   {"bench":"engine", ...}        AdamW through tsd: bf16 grads in, bf16 params out, fp32 master,
//                                  fp32 or bf16 moments; Gparam/s and the share of the bandwidth
//                                  bound implied by the bytes each parameter moves
//   {"bench":"doorbell", ...}      ready -> updated round trip of an empty bucket, p50/p99, next
//                                  to a gRPC unary call (Status) to the same daemon
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// STREAM-style copy (a = b) and triad (a = b + s*c) over `n` floats per array with `threads`
// threads; best of `reps`. Returns GB/s counting the bytes each kernel reads and writes.
std::pair<double, double> Stream(size_t n, int threads, int reps) {
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  auto run = [&](auto body) {
    double best = 1e30;
    for (int r = 0; r < reps; ++r) {
      std::vector<std::thread> ts;
      const auto t0 = Clock::now();
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] {
          const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
          body(lo, hi);
        });
      }
      for (auto& t : ts) t.join();
      best = std::min(best, Seconds(t0, Clock::now()));
    }
    return best;
  };
  // First touch in parallel, so pages spread like the work.
  run([&](size_t lo, size_t hi) { std::memset(a.data() + lo, 0, (hi - lo) * 4); });
  const double copy =
      run([&](size_t lo, size_t hi) { std::memcpy(a.data() + lo, b.data() + lo, (hi - lo) * 4); });
  const double triad = run([&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.0f * c[i];
  });
  return {2.0 * n * 4 / copy / 1e9, 3.0 * n * 4 / triad / 1e9};
}

tsd::OptimizerSpec Spec(uint64_t params, int buckets, tsd::DType moments) {
  tsd::OptimizerSpec spec;
  spec.groups = {{.lr = 1e-4, .weight_decay = 0.01}};
  spec.moment_dtype = moments;
  for (int b = 0; b < buckets; ++b) {
    spec.buckets.push_back({0, params / buckets, tsd::DType::kBF16, tsd::DType::kBF16});
  }
  return spec;
}

nlohmann::json Engine(const std::string& socket, uint64_t params, int buckets, int steps,
                      tsd::DType moments, double bandwidth_gbs) {
  auto client = tsd::Client::Connect(socket);
  if (!client.ok()) throw std::runtime_error(std::string(client.status().message()));
  const std::string job = moments == tsd::DType::kF32 ? "bench-fp32-moments" : "bench-bf16-moments";
  if (auto s = (*client)->Attach(job); !s.ok()) throw std::runtime_error(std::string(s.message()));
  const auto t_reg = Clock::now();
  auto opt = (*client)->RegisterOptimizer(Spec(params, buckets, moments));
  if (!opt.ok()) throw std::runtime_error(std::string(opt.status().message()));
  const double register_s = Seconds(t_reg, Clock::now());
  auto& o = **opt;
  for (size_t b = 0; b < o.num_buckets(); ++b) {
    std::fill(o.master(b), o.master(b) + o.numel(b), 0.5f);
    auto* g = static_cast<uint16_t*>(o.grad(b));
    for (uint64_t i = 0; i < o.numel(b); ++i)
      g[i] = static_cast<uint16_t>(0x3c00 + (i & 0xff));  // bf16 ~0.0078
  }
  auto step = [&] {
    for (size_t b = 0; b < o.num_buckets(); ++b) {
      if (!o.Ready(b).ok()) throw std::runtime_error("ready failed");
    }
    if (!o.WaitAll().ok()) throw std::runtime_error("wait failed");
  };
  step();  // warm-up
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto t0 = Clock::now();
    step();
    times.push_back(Seconds(t0, Clock::now()));
  }
  std::sort(times.begin(), times.end());
  const double med = times[times.size() / 2];
  const uint64_t n = params / buckets * buckets;
  // Bytes per parameter: grad (bf16) read, master read+write, both moments read+write, param
  // (bf16) written.
  const double msize = moments == tsd::DType::kF32 ? 4 : 2;
  const double bytes_per_param = 2 + 8 + 4 * msize + 2;
  const double gparams = n / med / 1e9;
  const double bound = bandwidth_gbs / bytes_per_param;
  return {{"bench", "engine"},
          {"moments", moments == tsd::DType::kF32 ? "fp32" : "bf16"},
          {"params", n},
          {"buckets", buckets},
          {"daemon_threads", o.threads()},
          {"isa", o.isa()},
          {"step_s_median", med},
          {"gparam_per_s", gparams},
          {"bytes_per_param", bytes_per_param},
          {"bound_gparam_per_s", bound},
          {"share_of_bound", gparams / bound},
          {"bandwidth_gb_per_s", bandwidth_gbs},
          {"register_s", register_s}};
}

nlohmann::json Doorbell(const std::string& socket, int iters) {
  auto client = tsd::Client::Connect(socket);
  if (!client.ok()) throw std::runtime_error(std::string(client.status().message()));
  if (auto s = (*client)->Attach("bench-doorbell"); !s.ok())
    throw std::runtime_error(std::string(s.message()));
  tsd::OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 0, tsd::DType::kF32, tsd::DType::kF32}};
  auto opt = (*client)->RegisterOptimizer(spec);
  if (!opt.ok()) throw std::runtime_error(std::string(opt.status().message()));
  std::vector<double> ring, grpc;
  for (int i = 0; i < iters + 100; ++i) {
    const auto t0 = Clock::now();
    if (!(*opt)->Ready(0).ok() || !(*opt)->Wait(0).ok())
      throw std::runtime_error("doorbell failed");
    if (i >= 100) ring.push_back(Seconds(t0, Clock::now()) * 1e6);
  }
  for (int i = 0; i < iters / 4 + 100; ++i) {
    const auto t0 = Clock::now();
    if (!(*client)->Status().ok()) throw std::runtime_error("status failed");
    if (i >= 100) grpc.push_back(Seconds(t0, Clock::now()) * 1e6);
  }
  auto pct = [](std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(p * (v.size() - 1))];
  };
  return {{"bench", "doorbell"},
          {"iters", iters},
          {"doorbell_p50_us", pct(ring, 0.5)},
          {"doorbell_p99_us", pct(ring, 0.99)},
          {"grpc_unary_p50_us", pct(grpc, 0.5)},
          {"grpc_unary_p99_us", pct(grpc, 0.99)}};
}

uint64_t ParseCount(const std::string& s) {
  const char unit = s.empty() ? '\0' : s.back();
  const uint64_t mult = unit == 'M'   ? 1000000ull
                        : unit == 'G' ? 1000000000ull
                        : unit == 'K' ? 1000ull
                                      : 1;
  return std::stoull(mult == 1 ? s : s.substr(0, s.size() - 1)) * mult;
}

}  // namespace

int main(int argc, char** argv) {
  std::string socket, only;
  uint64_t params = 256000000;
  int buckets = 64, steps = 5, threads = static_cast<int>(std::thread::hardware_concurrency()),
      iters = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--socket")
      socket = v;
    else if (k == "--params")
      params = ParseCount(v);
    else if (k == "--buckets")
      buckets = std::stoi(v);
    else if (k == "--steps")
      steps = std::stoi(v);
    else if (k == "--threads")
      threads = std::stoi(v);
    else if (k == "--iters")
      iters = std::stoi(v);
    else if (k == "--only")
      only = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    double triad = 0;
    if (only.empty() || only == "engine" || only == "stream") {
      const auto [copy, tri] = Stream(std::max<uint64_t>(params, 64ull << 20), threads, 5);
      triad = std::max(copy, tri);  // the bandwidth the bound is computed from
      std::printf("%s\n", nlohmann::json({{"bench", "stream"},
                                          {"threads", threads},
                                          {"copy_gb_per_s", copy},
                                          {"triad_gb_per_s", tri}})
                              .dump()
                              .c_str());
      std::fflush(stdout);
    }
    if (only.empty() || only == "engine") {
      std::printf("%s\n",
                  Engine(socket, params, buckets, steps, tsd::DType::kF32, triad).dump().c_str());
      std::fflush(stdout);
      std::printf("%s\n",
                  Engine(socket, params, buckets, steps, tsd::DType::kBF16, triad).dump().c_str());
      std::fflush(stdout);
    }
    if (only.empty() || only == "doorbell") {
      std::printf("%s\n", Doorbell(socket, iters).dump().c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "optimizer_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
