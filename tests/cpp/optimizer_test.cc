// The optimizer engine end to end, through a real daemon: AdamW equal to torch.optim.AdamW's
// arithmetic over 20 steps (two groups, weight decay, a changing lr, accumulation, clipping), bf16
// slots, two jobs at once, state saved and loaded bit-exactly, unsupported options refused, a
// client killed mid-update, and garbage on the control page.
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "adamw_reference.h"
#include "attached_optimizer.h"
#include "daemon_process.h"
#include "proto/control_page.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

// 20 steps, two groups (one without weight decay), lr changing every step, 2 micro-steps of
// accumulation, clipping by a global norm that bites, buckets large enough to be split across
// worker threads and small enough to run inline.
TEST(Optimizer, TwentyStepsMatchTorchAdamW) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB", "--optimizer-threads", "2"}});
  ASSERT_TRUE(d);
  const RefLayout layout = TwoGroupLayout(/*max_grad_norm=*/1.0, /*accumulate=*/true);
  const std::vector<uint64_t>& sizes = layout.sizes;
  const std::vector<uint32_t>& group_of = layout.group_of;
  const OptimizerSpec& spec = layout.spec;
  auto s = AttachOptimizer(*d, "adamw-ref", spec);
  ASSERT_TRUE(s.opt);
  std::mt19937 rng(7);
  std::vector<RefParam> ref = RandomRef(sizes, rng);
  for (size_t b = 0; b < sizes.size(); ++b) {
    std::memcpy(s.opt->master(b), ref[b].p.data(), sizes[b] * 4);
  }
  bool clipped_some = false;
  for (int step = 1; step <= 20; ++step) {
    std::vector<GroupHyper> hyper = spec.groups;
    for (auto& h : hyper) h.lr *= (1.0 + 0.05 * step);  // a scheduler
    for (size_t g = 0; g < hyper.size(); ++g) EXPECT_TRUE(s.opt->SetGroup(g, hyper[g]).ok());
    std::vector<std::vector<float>> acc(sizes.size());
    for (int micro = 0; micro < 2; ++micro) {
      for (size_t b = 0; b < sizes.size(); ++b) {
        ASSERT_TRUE(s.opt->Wait(b).ok());
        auto g = RandomVec(sizes[b], rng, step < 5 ? 2.0f : 0.01f);
        std::memcpy(s.opt->grad(b), g.data(), sizes[b] * 4);
        ASSERT_TRUE(s.opt->Ready(b, micro == 0, micro == 1).ok());
        if (micro == 0) {
          acc[b] = g;
        } else {
          for (size_t i = 0; i < g.size(); ++i) acc[b][i] += g[i];
        }
      }
    }
    ASSERT_TRUE(s.opt->Commit().ok());
    const auto [norm, coef] = ClipOf(acc, 1.0);
    clipped_some |= coef < 1.0f;
    EXPECT_NEAR(s.opt->last_grad_norm(), norm, 1e-5 * norm);
    for (size_t b = 0; b < sizes.size(); ++b) RefStep(ref[b], acc[b], hyper[group_of[b]], coef);
  }
  EXPECT_TRUE(clipped_some);
  for (size_t b = 0; b < sizes.size(); ++b) {
    EXPECT_EQ(s.opt->steps(b), 20u);
    const double rel = MaxRelDiff(s.opt->master(b), ref[b].p);
    EXPECT_LE(rel, 1e-6) << "bucket " << b;
    EXPECT_EQ(std::memcmp(s.opt->param(b), s.opt->master(b), sizes[b] * 4), 0);  // fp32 param slot
  }
}

TEST(Optimizer, Bf16SlotsAndNoClipOverlapPath) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-2, .weight_decay = 0.01}};
  spec.buckets = {{0, 500000, DType::kBF16, DType::kBF16}, {0, 17, DType::kF16, DType::kF16}};
  auto s = AttachOptimizer(*d, "bf16", spec);
  ASSERT_TRUE(s.opt);
  std::mt19937 rng(3);
  std::vector<RefParam> ref(2);
  for (size_t b = 0; b < 2; ++b) {
    ref[b].p = RandomVec(spec.buckets[b].numel, rng, 1.0f);
    ref[b].m.assign(ref[b].p.size(), 0);
    ref[b].v.assign(ref[b].p.size(), 0);
    std::memcpy(s.opt->master(b), ref[b].p.data(), ref[b].p.size() * 4);
  }
  auto to_bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
  };
  for (int step = 0; step < 5; ++step) {
    for (size_t b = 0; b < 2; ++b) {
      const size_t n = ref[b].p.size();
      auto g = RandomVec(n, rng, 0.1f);
      std::vector<float> g_seen(n);
      auto* slot = static_cast<uint16_t*>(s.opt->grad(b));
      for (size_t i = 0; i < n; ++i) {
        if (b == 0) {
          slot[i] = to_bf16(g[i]);
          uint32_t u = static_cast<uint32_t>(slot[i]) << 16;
          std::memcpy(&g_seen[i], &u, 4);
        } else {
          _Float16 h = static_cast<_Float16>(g[i]);
          std::memcpy(&slot[i], &h, 2);
          g_seen[i] = static_cast<float>(h);
        }
      }
      ASSERT_TRUE(s.opt->Ready(b).ok());
      RefStep(ref[b], g_seen, spec.groups[0], 1.0f);
    }
    ASSERT_TRUE(s.opt->WaitAll().ok());
  }
  EXPECT_LE(MaxRelDiff(s.opt->master(0), ref[0].p), 1e-6);
  EXPECT_LE(MaxRelDiff(s.opt->master(1), ref[1].p), 1e-6);
  const auto* out = static_cast<const uint16_t*>(s.opt->param(0));
  for (size_t i = 0; i < ref[0].p.size(); i += 997)
    EXPECT_EQ(out[i], to_bf16(s.opt->master(0)[i])) << i;
}

// Runs `steps` steps of a fixed workload and returns the master weights.
std::vector<float> RunWorkload(Optimizer& opt, uint64_t seed, int steps) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const size_t n = opt.numel(0);
  auto p = RandomVec(n, rng, 1.0f);
  std::memcpy(opt.master(0), p.data(), n * 4);
  for (int s = 0; s < steps; ++s) {
    auto g = RandomVec(n, rng, 0.1f);
    std::memcpy(opt.grad(0), g.data(), n * 4);
    EXPECT_TRUE(opt.Ready(0).ok());
    EXPECT_TRUE(opt.Wait(0).ok());
  }
  return std::vector<float>(opt.master(0), opt.master(0) + n);
}

// The forward order (SetOrder): the commit can return once handed over, each bucket is waited
// for on its own, and the results are bit-identical to a job without an order. Bad orders are
// refused. (The pool's ordering itself: WorkerPool.TasksRunByPriorityThenInSubmissionOrder.)
TEST(Optimizer, ForwardOrderSetsTheUpdateOrderAndChangesNoResult) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB", "--optimizer-threads", "1"}});
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3}};
  for (int b = 0; b < 6; ++b) spec.buckets.push_back({0, 300000, DType::kF32, DType::kF32});
  spec.max_grad_norm = 0.5;  // bites: every update waits for the commit
  auto ordered = AttachOptimizer(*d, "ordered", spec);
  auto plain = AttachOptimizer(*d, "plain", spec);
  ASSERT_TRUE(ordered.opt && plain.opt);
  EXPECT_THAT(ordered.opt->SetOrder({0, 6}).message(), HasSubstr("bucket 6"));
  EXPECT_THAT(ordered.opt->SetOrder({1, 1}).message(), HasSubstr("twice"));
  const std::vector<size_t> forward = {4, 2, 0, 5, 3};  // bucket 1: no order, so last
  ASSERT_TRUE(ordered.opt->SetOrder(forward).ok());
  std::mt19937 rng(11);
  for (int b = 0; b < 6; ++b) {
    auto p = RandomVec(300000, rng, 0.5f);
    std::memcpy(ordered.opt->master(b), p.data(), p.size() * 4);
    std::memcpy(plain.opt->master(b), p.data(), p.size() * 4);
  }
  for (uint32_t step = 1; step <= 3; ++step) {
    for (int b = 0; b < 6; ++b) {
      auto g = RandomVec(300000, rng, 1.0f);
      for (auto* o : {ordered.opt.get(), plain.opt.get()}) {
        std::memcpy(o->grad(b), g.data(), g.size() * 4);
        ASSERT_TRUE(o->Ready(b).ok());
      }
    }
    ASSERT_TRUE(ordered.opt->Commit(absl::Seconds(60), /*wait=*/false).ok());
    for (int b = 0; b < 6; ++b) ASSERT_TRUE(ordered.opt->Wait(b).ok());
    ASSERT_TRUE(ordered.opt->WaitCommitted().ok());
    ASSERT_TRUE(plain.opt->Commit().ok());
    EXPECT_EQ(ordered.opt->last_grad_norm(), plain.opt->last_grad_norm());
  }
  for (int b = 0; b < 6; ++b) {
    EXPECT_EQ(std::memcmp(ordered.opt->master(b), plain.opt->master(b), 300000 * 4), 0) << b;
  }
}

TEST(Optimizer, TwoJobsSteppingAtOnceEqualEachAlone) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB", "--optimizer-threads", "2"}});
  ASSERT_TRUE(d);
  OptimizerSpec big, small;
  big.groups = small.groups = {{.lr = 1e-3}};
  big.buckets = {{0, 4000000, DType::kF32, DType::kF32}};
  small.buckets = {{0, 40000, DType::kF32, DType::kF32}};
  std::vector<float> big_alone, small_alone, big_both, small_both;
  {
    auto a = AttachOptimizer(*d, "big", big);
    big_alone = RunWorkload(*a.opt, 1, 10);
  }
  {
    auto b = AttachOptimizer(*d, "small", small);
    small_alone = RunWorkload(*b.opt, 2, 10);
  }
  auto a = AttachOptimizer(*d, "big2", big);
  auto b = AttachOptimizer(*d, "small2", small);
  std::thread ta([&] { big_both = RunWorkload(*a.opt, 1, 10); });
  std::thread tb([&] { small_both = RunWorkload(*b.opt, 2, 10); });
  ta.join();
  tb.join();
  EXPECT_EQ(big_alone, big_both);
  EXPECT_EQ(small_alone, small_both);
}

TEST(Optimizer, StateSavedAndLoadedResumesBitExactly) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3}};
  spec.buckets = {{0, 300000, DType::kF32, DType::kBF16}, {0, 1000, DType::kF32, DType::kF32}};
  spec.moment_dtype = DType::kBF16;
  auto run = [](Optimizer& opt, std::mt19937& rng, int steps) {
    for (int s = 0; s < steps; ++s) {
      for (size_t b = 0; b < opt.num_buckets(); ++b) {
        auto g = RandomVec(opt.numel(b), rng, 0.1f);
        std::memcpy(opt.grad(b), g.data(), g.size() * 4);
        ASSERT_TRUE(opt.Ready(b).ok());
      }
      ASSERT_TRUE(opt.WaitAll().ok());
    }
  };
  auto a = AttachOptimizer(*d, "uninterrupted", spec);
  std::mt19937 rng(11);
  for (size_t b = 0; b < 2; ++b) {
    auto p = RandomVec(a.opt->numel(b), rng, 1.0f);
    std::memcpy(a.opt->master(b), p.data(), p.size() * 4);
  }
  run(*a.opt, rng, 5);
  const int file = memfd_create("state", MFD_CLOEXEC);
  auto saved = a.opt->SaveState(file);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_GT(*saved, 300000u * 8);
  std::mt19937 rng_resume = rng;
  run(*a.opt, rng, 5);
  // A fresh job loads the state and runs the same last 5 steps.
  auto b = AttachOptimizer(*d, "resumed", spec);
  auto loaded = b.opt->LoadState(file);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*loaded, *saved);
  EXPECT_EQ(b.opt->steps(0), 5u);
  run(*b.opt, rng_resume, 5);
  for (size_t bk = 0; bk < 2; ++bk) {
    EXPECT_EQ(std::memcmp(a.opt->master(bk), b.opt->master(bk), a.opt->numel(bk) * 4), 0) << bk;
    EXPECT_EQ(b.opt->steps(bk), 10u);
  }
  // Saving again gives the same bytes as the uninterrupted run's state.
  const int fa = memfd_create("a", MFD_CLOEXEC), fb = memfd_create("b", MFD_CLOEXEC);
  ASSERT_TRUE(a.opt->SaveState(fa).ok());
  ASSERT_TRUE(b.opt->SaveState(fb).ok());
  const off_t size = lseek(fa, 0, SEEK_END);
  ASSERT_EQ(size, lseek(fb, 0, SEEK_END));
  std::vector<char> ba(static_cast<size_t>(size)), bb(static_cast<size_t>(size));
  ASSERT_EQ(pread(fa, ba.data(), ba.size(), 0), size);
  ASSERT_EQ(pread(fb, bb.data(), bb.size(), 0), size);
  EXPECT_EQ(ba, bb);
  // A state of another layout, a corrupt file and a pipe are refused and change nothing.
  const std::vector<float> before(b.opt->master(1), b.opt->master(1) + 1000);
  OptimizerSpec other = spec;
  other.buckets[1].numel = 999;
  auto c = AttachOptimizer(*d, "other-layout", other);
  auto refused = c.opt->LoadState(fa);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("b1.master"));
  ASSERT_EQ(pwrite(fb, "garbage!", 8, 0), 8);
  EXPECT_EQ(b.opt->LoadState(fb).status().code(), absl::StatusCode::kInvalidArgument);
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  EXPECT_THAT(std::string(b.opt->SaveState(pipefd[1]).status().message()),
              HasSubstr("regular file"));
  EXPECT_EQ(std::vector<float>(b.opt->master(1), b.opt->master(1) + 1000), before);
  close(pipefd[0]);
  close(pipefd[1]);
  close(file);
  close(fa);
  close(fb);
}

TEST(Optimizer, PartialStateHoldsTheChosenBucketsAndIsNotLoadable) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3}};
  spec.buckets = {{0, 5000, DType::kF32, DType::kF32},
                  {0, 300, DType::kF32, DType::kF32},
                  {0, 7000, DType::kF32, DType::kF32}};
  auto a = AttachOptimizer(*d, "partial", spec);
  std::mt19937 rng(3);
  for (int s = 0; s < 2; ++s) {
    for (size_t b = 0; b < 3; ++b) {
      auto g = RandomVec(a.opt->numel(b), rng, 0.1f);
      std::memcpy(a.opt->grad(b), g.data(), g.size() * 4);
      ASSERT_TRUE(a.opt->Ready(b).ok());
    }
    ASSERT_TRUE(a.opt->WaitAll().ok());
  }
  const int whole = memfd_create("whole", MFD_CLOEXEC), part = memfd_create("part", MFD_CLOEXEC);
  ASSERT_TRUE(a.opt->SaveState(whole).ok());
  const std::vector<uint32_t> chosen = {0, 2};
  auto written = a.opt->SaveState(part, chosen);
  ASSERT_TRUE(written.ok()) << written.status();
  // Only buckets 0 and 2: their fp32 master and moments (12 bytes per element) and two steps.
  EXPECT_GT(*written, 12u * 12000);
  EXPECT_LT(*written, 12u * 12000 + 4096);
  std::string file(static_cast<size_t>(*written), '\0');
  ASSERT_EQ(pread(part, file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
  EXPECT_THAT(file, HasSubstr("\"b2.exp_avg\""));
  EXPECT_THAT(file, HasSubstr("\"partial\":\"2\""));
  EXPECT_EQ(file.find("\"b1."), std::string::npos);
  // Bucket 2's master is the same bytes in both files (at its own offsets).
  const float* master = a.opt->master(2);
  EXPECT_NE(file.find(std::string(reinterpret_cast<const char*>(master), 7000 * 4)),
            std::string::npos);
  // A partial file is refused by LoadState, changing nothing; bad lists are refused.
  const std::vector<float> before(a.opt->master(1), a.opt->master(1) + 300);
  auto refused = a.opt->LoadState(part);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("only some of the buckets"));
  EXPECT_EQ(std::vector<float>(a.opt->master(1), a.opt->master(1) + 300), before);
  const std::vector<uint32_t> out_of_range = {1, 3}, unordered = {2, 0}, twice = {1, 1};
  EXPECT_THAT(std::string(a.opt->SaveState(part, out_of_range).status().message()),
              HasSubstr("bucket 3 does not exist"));
  EXPECT_THAT(std::string(a.opt->SaveState(part, unordered).status().message()),
              HasSubstr("strictly ascending"));
  EXPECT_EQ(a.opt->SaveState(part, twice).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(a.opt->LoadState(whole).ok());  // the session is still usable
  close(whole);
  close(part);
}

TEST(Optimizer, UnsupportedOptionsAndBadLayoutsAreRefused) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("refusals", 64 << 20).ok());
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 1000, DType::kF32, DType::kF32}};
  OptimizerSpec ams = spec;
  ams.amsgrad = true;
  auto r = c->RegisterOptimizer(ams);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("amsgrad"));
  OptimizerSpec max = spec;
  max.maximize = true;
  EXPECT_THAT(std::string(c->RegisterOptimizer(max).status().message()), HasSubstr("maximize"));
  OptimizerSpec f16 = spec;
  f16.moment_dtype = DType::kF16;
  EXPECT_EQ(c->RegisterOptimizer(f16).status().code(), absl::StatusCode::kInvalidArgument);
  OptimizerSpec bad_group = spec;
  bad_group.buckets[0].group = 5;
  EXPECT_THAT(std::string(c->RegisterOptimizer(bad_group).status().message()),
              HasSubstr("names group 5"));
  OptimizerSpec bad_beta = spec;
  bad_beta.groups[0].beta2 = 1.0;
  EXPECT_THAT(std::string(c->RegisterOptimizer(bad_beta).status().message()), HasSubstr("beta2"));
  OptimizerSpec too_big = spec;
  too_big.buckets[0].numel = 10ull << 20;  // 10M params need 160 MiB: over the 64 MiB quota
  auto over = c->RegisterOptimizer(too_big);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("quota"));
  EXPECT_EQ(c->Status()->used_bytes, 0u);  // nothing was left behind
  auto ok = c->RegisterOptimizer(spec);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(c->RegisterOptimizer(spec).status().code(), absl::StatusCode::kAlreadyExists);
  // Optimizer regions are the daemon's: a client can neither create nor free them by name.
  EXPECT_EQ(c->Alloc("opt/mine", 4096).status().code(), absl::StatusCode::kInvalidArgument);
  auto master = c->Map("opt/master");
  ASSERT_TRUE(master.ok());
  EXPECT_EQ(c->Free(*master).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(Optimizer, GarbageOnTheControlPageClosesTheSessionNotTheDaemon) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 1000, DType::kF32, DType::kF32}, {0, 1000, DType::kF32, DType::kF32}};
  auto bystander = AttachOptimizer(*d, "bystander", spec);
  ASSERT_TRUE(bystander.opt);
  struct Case {
    const char* what;
    std::function<void(wire::ControlView)> poke;
    const char* says;
  };
  const Case cases[] = {
      {"skipped counter", [](wire::ControlView v) { v.buckets[0].ready.store(5); },
       "may only advance by one"},
      {"wrapped counter", [](wire::ControlView v) { v.buckets[1].ready.store(~0ull); },
       "may only advance by one"},
      {"unknown flags",
       [](wire::ControlView v) {
         v.buckets[0].flags.store(0xF0);
         v.buckets[0].ready.store(1);
       },
       "unknown flag bits"},
      {"NaN learning rate",
       [](wire::ControlView v) {
         v.groups[0].lr = std::nan("");
         v.buckets[0].flags.store(3);
         v.buckets[0].ready.store(1);
       },
       "invalid learning rate"},
      {"accumulation not registered",
       [](wire::ControlView v) {
         v.buckets[0].flags.store(1);
         v.buckets[0].ready.store(1);
       },
       "without accumulate"},
      {"bad commit", [](wire::ControlView v) { v.header->commit.store(7); }, "commit counter"},
  };
  for (const auto& tc : cases) {
    auto victim = AttachOptimizer(*d, std::string("victim-") + std::to_string(&tc - cases), spec);
    ASSERT_TRUE(victim.opt) << tc.what;
    auto page = victim.client->Map("opt/control");
    ASSERT_TRUE(page.ok());
    auto view = wire::ControlView::Of((*page)->data(), 1);
    tc.poke(view);
    view.header->doorbell.fetch_add(1);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&view.header->doorbell), FUTEX_WAKE, 1, nullptr,
            nullptr, 0);
    ASSERT_TRUE(WaitFor([&] { return view.header->failed.load() != 0; }, 5))
        << tc.what << ": not detected";
    auto refused = victim.opt->Commit(absl::Seconds(5));
    EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << tc.what << ": " << refused;
    EXPECT_THAT(std::string(refused.message()), HasSubstr(tc.says)) << tc.what;
    EXPECT_TRUE(WaitFor([&] { return !victim.client->ListRegions().ok(); }, 2))
        << tc.what << ": session not closed";
    // The daemon said why before it closed the connection, and the reason stays readable.
    auto notice = victim.client->LastNotice();
    ASSERT_TRUE(notice.has_value()) << tc.what << ": no notice";
    EXPECT_EQ(notice->kind, Notice::Kind::kSessionClosed) << tc.what;
    EXPECT_THAT(notice->message, HasSubstr(tc.says)) << tc.what;
    auto later = victim.client->ListRegions();
    EXPECT_EQ(later.status().code(), absl::StatusCode::kAborted) << tc.what;  // SessionClosed
    EXPECT_THAT(std::string(later.status().message()), HasSubstr(tc.says)) << tc.what;
    EXPECT_FALSE(victim.client->attached()) << tc.what;
    // The log lines follow the close; the daemon may write them a moment after the client sees it.
    EXPECT_TRUE(WaitFor(
        [&] {
          const std::string log = d->log();
          return log.find("event=optimizer_failed") != std::string::npos &&
                 log.find("reason=optimizer_failed") != std::string::npos;
        },
        5))
        << tc.what << ": " << d->log();
  }
  // The bystander's optimizer keeps working.
  std::memset(bystander.opt->grad(0), 0, 4000);
  ASSERT_TRUE(bystander.opt->Ready(0).ok());
  ASSERT_TRUE(bystander.opt->Wait(0).ok());
  EXPECT_EQ(bystander.opt->steps(0), 1u);
}

// Issue 13, defect 6: once tsd has closed a session for a protocol violation, releasing the job
// zeroes the control page, so the page shows no failure. Every later call of the optimizer must
// still fail, with the same error, naming the reason (it used to accept the next Ready).
TEST(Optimizer, EveryCallAfterSessionClosedRaisesTheSameReason) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 1000, DType::kF32, DType::kF32}};
  auto victim = AttachOptimizer(*d, "closed-victim", spec);
  ASSERT_TRUE(victim.opt);
  {
    auto page = victim.client->Map("opt/control");
    ASSERT_TRUE(page.ok());
    auto view = wire::ControlView::Of((*page)->data(), 1);
    view.buckets[0].ready.store(5);  // a skipped counter: a protocol violation
    view.header->doorbell.fetch_add(1);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&view.header->doorbell), FUTEX_WAKE, 1, nullptr,
            nullptr, 0);
  }
  // Wait until the daemon released the job (without calling the optimizer, which would read the
  // failure from the page while it is still there).
  ASSERT_TRUE(WaitFor(
      [&] {
        auto jobs = d->Connect()->Jobs();
        return jobs.ok() && std::none_of(jobs->begin(), jobs->end(), [](const JobStatus& j) {
                 return j.name == "closed-victim";
               });
      },
      5));
  const absl::Status first = victim.opt->Ready(0);
  EXPECT_EQ(first.code(), absl::StatusCode::kAborted) << first;
  EXPECT_THAT(std::string(first.message()), HasSubstr("may only advance by one"));
  EXPECT_THAT(std::string(first.message()), HasSubstr("can take no more steps"));
  EXPECT_EQ(victim.opt->Ready(0), first);
  EXPECT_EQ(victim.opt->Wait(0, absl::Seconds(1)), first);
  EXPECT_EQ(victim.opt->Commit(absl::Seconds(1)), first);
  EXPECT_EQ(victim.opt->SetGroup(0, {}), first);
}

// Hyperparameters are checked on the client before they reach the control page (where a bad
// one is a protocol violation that closes the optimizer): each is refused by name and nothing
// changes; the optimizer keeps working.
TEST(Optimizer, BadHyperparametersAreRefusedBeforeThePage) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 100, DType::kF32, DType::kF32}};
  auto s = AttachOptimizer(*d, "hyper", spec);
  ASSERT_TRUE(s.opt);
  ASSERT_TRUE(s.opt->SetGroup(0, {.lr = 0.5}).ok());
  const double inf = std::numeric_limits<double>::infinity();
  const struct {
    GroupHyper h;
    const char* says;
  } bad[] = {
      {{.lr = std::nan("")}, "lr = nan"},
      {{.lr = -1e-3}, "lr = -0.001"},
      {{.lr = inf}, "lr = inf"},
      {{.beta1 = 1.0}, "beta1 = 1"},
      {{.beta1 = -0.1}, "beta1 = -0.1"},
      {{.beta2 = std::nan("")}, "beta2 = nan"},
      {{.eps = 0}, "eps = 0"},
      {{.eps = inf}, "eps = inf"},
      {{.weight_decay = std::nan("")}, "weight_decay = nan"},
  };
  for (const auto& b : bad) {
    const absl::Status st = s.opt->SetGroup(0, b.h);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << b.says;
    EXPECT_THAT(std::string(st.message()), HasSubstr(b.says));
    EXPECT_THAT(std::string(st.message()), HasSubstr("parameter group 0"));
  }
  EXPECT_EQ(s.opt->SetGroup(1, {}).code(), absl::StatusCode::kInvalidArgument);
  auto page = s.client->Map("opt/control");
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(wire::ControlView::Of((*page)->data(), 1).groups[0].lr, 0.5);  // unchanged
  std::memset(s.opt->grad(0), 0, 400);
  ASSERT_TRUE(s.opt->Ready(0).ok());
  ASSERT_TRUE(s.opt->Wait(0).ok());
  EXPECT_EQ(s.opt->steps(0), 1u);
}

// A state file in a memfd: the 8-byte length of `header`, the header, 64 zero bytes of data.
// Returns the descriptor, or -1 when it could not be written.
int StateFile(const std::string& header) {
  const int fd = memfd_create("state", MFD_CLOEXEC);
  if (fd < 0) return -1;
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  file += header + std::string(64, '\0');
  if (write(fd, file.data(), file.size()) != static_cast<ssize_t>(file.size())) {
    close(fd);
    return -1;
  }
  return fd;
}

// Found by fuzz_state_file (issue 13): a state file whose header has a "dtype" or "format" that is
// not a string made the JSON library throw inside load_state, and the uncaught exception ended
// the daemon. Each such file is refused with INVALID_ARGUMENT; the daemon and the job live on.
TEST(Optimizer, StateFileWithNonStringFieldsIsRefusedNotFatal) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 3, DType::kF32, DType::kF32}};
  auto s = AttachOptimizer(*d, "state-poison", spec);
  ASSERT_TRUE(s.opt);
  const std::string good_meta = R"("__metadata__":{"format":"tsd.optimizer.v1"})";
  const std::string headers[] = {
      R"({"__metadata__":{"format":1}})",
      R"({"__metadata__":{"format":["tsd.optimizer.v1"]}})",
      "{" + good_meta + R"(,"b0.master":{"data_offsets":[0,12],"dtype":[1],"shape":[3]}})",
      "{" + good_meta + R"(,"b0.master":{"data_offsets":[0,12],"dtype":7,"shape":[3]}})",
  };
  for (const std::string& header : headers) {
    const int fd = StateFile(header);
    ASSERT_GE(fd, 0);
    auto loaded = s.opt->LoadState(fd);
    close(fd);
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << header;
    ASSERT_TRUE(d->running()) << header;
    ASSERT_EQ(kill(d->pid(), 0), 0) << "tsd died on " << header << "\n" << d->log();
  }
  std::memset(s.opt->grad(0), 0, 12);
  ASSERT_TRUE(s.opt->Ready(0).ok());
  ASSERT_TRUE(s.opt->Wait(0).ok());
}

// A state header is bounded before it is parsed into a document: deeper than a state header
// goes (3 levels), or with more values than the job's layout has, it is refused without the daemon
// building it (a document of a 32 MiB header of nested arrays would cost it over a GiB). The
// daemon's peak memory grows by about the header's bytes, and the job lives on.
TEST(Optimizer, StateFileHeadersAreBoundedBeforeTheyAreParsed) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 3, DType::kF32, DType::kF32}};
  auto s = AttachOptimizer(*d, "state-bound", spec);
  ASSERT_TRUE(s.opt);
  const uint64_t before = d->PeakRssKib();
  constexpr size_t kBytes = 32 << 20;
  const std::string meta = R"({"__metadata__":{"format":"tsd.optimizer.v1"},"b0.master":)";
  std::string wide = meta + "[0";
  wide.reserve(kBytes + 64);
  while (wide.size() < kBytes) wide += ",0";
  wide += "]}";
  const std::pair<std::string, std::string> cases[] = {
      {meta + std::string(kBytes / 2, '[') + std::string(kBytes / 2, ']') + "}",
       "nests deeper than the 3 levels"},
      {wide, "more than"},
  };
  for (const auto& [header, why] : cases) {
    const int fd = StateFile(header);
    ASSERT_GE(fd, 0);
    auto loaded = s.opt->LoadState(fd);
    close(fd);
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(why));
  }
  ExpectPeakRssGrowthBelow(*d, before, 3 * (kBytes >> 10) + (32 << 10), "32 MiB headers");
  std::memset(s.opt->grad(0), 0, 12);
  ASSERT_TRUE(s.opt->Ready(0).ok());
  ASSERT_TRUE(s.opt->Wait(0).ok());
}

TEST(Optimizer, ClientKilledWhileItsBucketIsUpdated) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "1GiB"}});
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  ASSERT_TRUE(observer->Attach("observer").ok());
  for (int round = 0; round < 5; ++round) {
    int out[2];
    ASSERT_EQ(pipe(out), 0);
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], 1);
      execl(TSD_TEST_CLIENT, TSD_TEST_CLIENT, "optimizer-loop", d->socket().c_str(),
            "killed-mid-step", nullptr);
      _exit(127);
    }
    close(out[1]);
    char buf[32] = {};
    ASSERT_GT(read(out[0], buf, sizeof(buf) - 1), 0);
    close(out[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 15 * round));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ASSERT_TRUE(WaitFor(
        [&] { return observer->Status()->used_bytes == 0 && observer->Status()->jobs == 1; }, 5))
        << "round " << round;
  }
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 100000, DType::kF32, DType::kF32}};
  auto after = observer->RegisterOptimizer(spec);
  ASSERT_TRUE(after.ok());
  ASSERT_TRUE((*after)->Ready(0).ok());
  EXPECT_TRUE((*after)->Wait(0).ok());
}

}  // namespace
}  // namespace tsd::testing
