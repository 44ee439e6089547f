// torch_trainer: a libtorch training loop whose optimizer lives in tsd.
//
// A small MLP (torch::nn) learns a fixed regression task. Its AdamW state (fp32 master weights
// and moments) is not in this process: each parameter is one bucket of a tsd optimizer
// (Client::RegisterOptimizer). Each step the trainer runs forward and backward with libtorch,
// writes every gradient into its bucket's gradient slot and marks it ready, and tsd's CPU
// threads run AdamW on it while the trainer hands over the next ones; the updated parameters
// come back in the parameter slots and are copied into the model. After each step it tells tsd
// how long it waited (ReportStep), which `tsctl top` shows.
//
// With --check, a second copy of the model (same initial weights, same data) is trained with a
// reference AdamW written here in plain C++ (torch.optim.AdamW's update, fp32), and the program
// prints PASS and exits 0 when every parameter of the two agrees within --tolerance after the
// last step, else FAIL and exits 1.
//
//   usage: torch_trainer [--socket PATH] [--steps N] [--lr X] [--check] [--tolerance X]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace {

struct Options {
  std::string socket;
  int steps = 20;
  double lr = 1e-2;
  double weight_decay = 1e-2;
  bool check = false;
  double tolerance = 1e-6;
};

// The model: 16 -> 64 -> 4 with a tanh between.
struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

// AdamW as torch.optim.AdamW computes it (decoupled weight decay, bias corrections), in fp32:
// the reference tsd's results are checked against.
class ReferenceAdamW {
 public:
  ReferenceAdamW(std::vector<torch::Tensor> params, const tsd::GroupHyper& h)
      : params_(std::move(params)), h_(h) {
    for (const auto& p : params_) {
      m_.push_back(torch::zeros_like(p));
      v_.push_back(torch::zeros_like(p));
    }
  }
  void Step() {
    ++t_;
    const float lr = static_cast<float>(h_.lr), b1 = static_cast<float>(h_.beta1),
                b2 = static_cast<float>(h_.beta2), eps = static_cast<float>(h_.eps),
                wd = static_cast<float>(h_.weight_decay);
    const float bc1 = 1.0f - std::pow(b1, static_cast<float>(t_));
    const float bc2_sqrt = std::sqrt(1.0f - std::pow(b2, static_cast<float>(t_)));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      float* p = params_[i].data_ptr<float>();
      const float* g = params_[i].grad().data_ptr<float>();
      float* m = m_[i].data_ptr<float>();
      float* v = v_[i].data_ptr<float>();
      for (int64_t k = 0; k < params_[i].numel(); ++k) {
        p[k] *= 1.0f - lr * wd;
        m[k] = b1 * m[k] + (1.0f - b1) * g[k];
        v[k] = b2 * v[k] + (1.0f - b2) * g[k] * g[k];
        const float denom = std::sqrt(v[k]) / bc2_sqrt + eps;
        p[k] -= (lr / bc1) * m[k] / denom;
      }
    }
  }

 private:
  std::vector<torch::Tensor> params_, m_, v_;
  tsd::GroupHyper h_;
  int64_t t_ = 0;
};

int Die(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "torch_trainer: %s: %s\n", what, std::string(s.message()).c_str());
  return 1;
}

bool ParseArgs(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    try {
      if (arg == "--socket" && has_value) {
        o.socket = argv[++i];
      } else if (arg == "--steps" && has_value) {
        o.steps = std::stoi(argv[++i]);
      } else if (arg == "--lr" && has_value) {
        o.lr = std::stod(argv[++i]);
      } else if (arg == "--tolerance" && has_value) {
        o.tolerance = std::stod(argv[++i]);
      } else if (arg == "--check") {
        o.check = true;
      } else {
        return false;
      }
    } catch (const std::exception&) {
      std::fprintf(stderr, "torch_trainer: %s needs a number, got '%s'\n", arg.c_str(), argv[i]);
      return false;
    }
  }
  if (o.steps < 1) {
    std::fprintf(stderr, "torch_trainer: --steps must be at least 1\n");
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!ParseArgs(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: torch_trainer [--socket PATH] [--steps N] [--lr X] [--check] "
                 "[--tolerance X]\n");
    return 2;
  }
  torch::manual_seed(0);
  torch::set_num_threads(1);  // a tiny model: more threads only contend with tsd's
  Mlp model;
  Mlp reference;  // --check: the same weights, stepped by ReferenceAdamW
  {
    torch::NoGradGuard no_grad;
    auto src = model->parameters(), dst = reference->parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  // The task: y = sin(x A) for a fixed random A, on one fixed batch.
  const torch::Tensor x = torch::randn({128, 16});
  const torch::Tensor y = torch::sin(torch::matmul(x, torch::randn({16, 4})));

  auto client = tsd::Client::Connect(o.socket);
  if (!client.ok()) return Die("connect", client.status());
  const std::string job = "torch-trainer-" + std::to_string(getpid());
  if (auto s = (*client)->Attach(job, 64 << 20); !s.ok()) return Die("attach", s);

  // One bucket per parameter, all in one group.
  const tsd::GroupHyper hyper{.lr = o.lr, .weight_decay = o.weight_decay};
  std::vector<torch::Tensor> params = model->parameters();
  tsd::OptimizerSpec spec;
  spec.groups = {hyper};
  for (const auto& p : params) spec.buckets.push_back({.numel = static_cast<uint64_t>(p.numel())});
  auto registered = (*client)->RegisterOptimizer(spec);
  if (!registered.ok()) return Die("register the optimizer", registered.status());
  tsd::Optimizer& opt = **registered;
  for (size_t b = 0; b < params.size(); ++b) {
    std::memcpy(opt.master(b), params[b].data_ptr<float>(), params[b].numel() * sizeof(float));
  }
  std::printf("job '%s': %zu parameters in %zu buckets, AdamW on tsd's %u threads (%s)\n",
              job.c_str(),
              static_cast<size_t>(
                  std::accumulate(params.begin(), params.end(), int64_t{0},
                                  [](int64_t n, const torch::Tensor& p) { return n + p.numel(); })),
              opt.num_buckets(), opt.threads(), opt.isa().c_str());

  ReferenceAdamW ref_opt(reference->parameters(), hyper);
  for (int step = 1; step <= o.steps; ++step) {
    model->zero_grad();
    torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    // Hand every gradient to tsd, then collect the updated parameters.
    const auto wait_from = std::chrono::steady_clock::now();
    for (size_t b = 0; b < params.size(); ++b) {
      const torch::Tensor g = params[b].grad().contiguous();
      std::memcpy(opt.grad(b), g.data_ptr<float>(), g.numel() * sizeof(float));
      if (auto s = opt.Ready(b); !s.ok()) return Die("ready", s);
    }
    {
      torch::NoGradGuard no_grad;
      for (size_t b = 0; b < params.size(); ++b) {
        if (auto s = opt.Wait(b); !s.ok()) return Die("wait", s);
        std::memcpy(params[b].data_ptr<float>(), opt.param(b), params[b].numel() * sizeof(float));
      }
    }
    const auto waited = std::chrono::steady_clock::now() - wait_from;
    if (auto s = opt.ReportStep(absl::FromChrono(waited), 0, 0); !s.ok()) return Die("report", s);

    double ref_loss = 0;
    if (o.check) {
      reference->zero_grad();
      torch::Tensor l = torch::mse_loss(reference->forward(x), y);
      l.backward();
      ref_opt.Step();
      ref_loss = l.item<double>();
    }
    if (step == 1 || step == o.steps || step % 5 == 0) {
      std::printf("step %3d  loss %.6f", step, loss.item<double>());
      if (o.check) std::printf("  reference loss %.6f", ref_loss);
      std::printf("\n");
    }
  }
  if (!o.check) return 0;

  double max_diff = 0;
  auto ref_params = reference->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    max_diff = std::max(max_diff, (params[i] - ref_params[i]).abs().max().item<double>());
  }
  const bool pass = std::isfinite(max_diff) && max_diff <= o.tolerance;
  std::printf("max |tsd - reference AdamW| over %zu tensors after %d steps: %.3g (tolerance %g)\n",
              params.size(), o.steps, max_diff, o.tolerance);
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}
