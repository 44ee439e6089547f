// Clipping without a stall, through a real daemon: with max_grad_norm the daemon applies each final
// delivery as it arrives while the last step's norm was under 0.8x the limit, publishes it at the
// commit, and undoes and redoes it there when clipping bit or the hyperparameters changed. Two
// jobs are fed the same gradients, one speculating and one holding every update for its commit
// (hold_clipped_updates), beside torch's AdamW written out (adamw_reference.h):
//   - a step that speculates really updates before the commit (the holding job's masters do not
//     move), and publishes nothing (step counts, done counters) until the commit;
//   - until the first redo both jobs are bit-identical to the reference; after it, within 1e-6
//     (the undo is exact up to rounding: measured, 1 to 2 ulps of the largest parameters);
//   - the daemon's counters say which commits speculated and which redid, as computed here;
//   - an Inf gradient after speculation gives what torch gives (clip coefficient 0, NaN where the
//     Inf was), as the holding job does;
//   - the commit publishes the bucket the forward needs first while a large one is still being
//     speculated on, and applies that one with the step's hyperparameters.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "adamw_reference.h"
#include "attached_optimizer.h"
#include "daemon_process.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

std::vector<std::vector<float>> Masters(const Optimizer& opt) {
  std::vector<std::vector<float>> out;
  for (size_t b = 0; b < opt.num_buckets(); ++b)
    out.emplace_back(opt.master(b), opt.master(b) + opt.numel(b));
  return out;
}

bool AllMoved(const Optimizer& opt, const std::vector<std::vector<float>>& before) {
  for (size_t b = 0; b < opt.num_buckets(); ++b) {
    if (std::memcmp(opt.master(b), before[b].data(), before[b].size() * 4) == 0) return false;
  }
  return true;
}

bool WaitAllMoved(const Optimizer& opt, const std::vector<std::vector<float>>& before) {
  for (int i = 0; i < 5000; ++i) {
    if (AllMoved(opt, before)) return true;
    usleep(1000);
  }
  return false;
}

JobStatus::Activity ActivityOf(tsd::Client& c, const std::string& name) {
  auto jobs = c.Jobs();
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  if (jobs.ok()) {
    for (const auto& j : *jobs) {
      if (j.name == name) return j.activity;
    }
  }
  ADD_FAILURE() << "no job " << name;
  return {};
}

class Speculation : public ::testing::TestWithParam<bool> {};

TEST_P(Speculation, KeptWhenClippingDoesNotBiteRedoneWhenItDoes) {
  const bool accumulate = GetParam();
  const int micro_steps = accumulate ? 2 : 1;
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB", "--optimizer-threads", "2"}});
  ASSERT_TRUE(d);
  RefLayout layout = TwoGroupLayout(/*max_grad_norm=*/1.0, accumulate);
  const std::vector<uint64_t>& sizes = layout.sizes;
  const std::vector<uint32_t>& group_of = layout.group_of;
  OptimizerSpec& spec = layout.spec;
  AttachedOptimizer fast = AttachOptimizer(*d, "speculates", spec);
  spec.hold_clipped_updates = true;
  AttachedOptimizer held = AttachOptimizer(*d, "holds", spec);
  ASSERT_TRUE(fast.opt && held.opt);

  std::mt19937 rng(11);
  uint64_t total_numel = 0;
  for (uint64_t n : sizes) total_numel += n;
  std::vector<RefParam> ref = RandomRef(sizes, rng);
  for (size_t b = 0; b < sizes.size(); ++b) {
    std::memcpy(fast.opt->master(b), ref[b].p.data(), sizes[b] * 4);
    std::memcpy(held.opt->master(b), ref[b].p.data(), sizes[b] * 4);
  }
  // The step's gradient norm (max_grad_norm is 1): under 0.8 speculates next, above 1 bites.
  // Step 21 carries an Inf. Step 9 changes lr between the deliveries and the commit.
  const std::vector<double> target = {0.3, 0.3, 0.5, 3.0, 0.3, 0.3, 0.9, 0.5, 0.4, 0.4, 0.4,
                                      0.4, 0.4, 0.4, 1.2, 0.4, 0.4, 0.3, 0.4, 0.4, 0.4};
  constexpr int kLrChangedAt = 9, kInfAt = 21;
  double last = std::numeric_limits<double>::quiet_NaN();
  uint64_t want_speculated = 0, want_redone = 0;
  bool redone_yet = false;
  for (int step = 1; step <= static_cast<int>(target.size()); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<GroupHyper> hyper = spec.groups;
    for (auto& h : hyper) h.lr *= (1.0 + 0.05 * step);  // a scheduler
    for (size_t g = 0; g < hyper.size(); ++g) {
      ASSERT_TRUE(fast.opt->SetGroup(g, hyper[g]).ok());
      ASSERT_TRUE(held.opt->SetGroup(g, hyper[g]).ok());
    }
    const auto fast_before = Masters(*fast.opt);
    const auto held_before = Masters(*held.opt);
    const float scale = static_cast<float>(target[step - 1] / std::sqrt(total_numel * micro_steps));
    std::vector<std::vector<float>> acc(sizes.size());
    for (int micro = 0; micro < micro_steps; ++micro) {
      for (size_t b = 0; b < sizes.size(); ++b) {
        ASSERT_TRUE(fast.opt->Wait(b).ok());
        ASSERT_TRUE(held.opt->Wait(b).ok());
        auto g = RandomVec(sizes[b], rng, scale);
        if (step == kInfAt && b == 1 && micro == micro_steps - 1) g[300000] = INFINITY;
        std::memcpy(fast.opt->grad(b), g.data(), sizes[b] * 4);
        std::memcpy(held.opt->grad(b), g.data(), sizes[b] * 4);
        const bool first = micro == 0, final = micro == micro_steps - 1;
        ASSERT_TRUE(fast.opt->Ready(b, first, final).ok());
        ASSERT_TRUE(held.opt->Ready(b, first, final).ok());
        if (first) {
          acc[b] = g;
        } else {
          for (size_t i = 0; i < g.size(); ++i) acc[b][i] += g[i];
        }
      }
    }
    const auto [norm, coef] = ClipOf(acc, 1.0);
    const bool speculates = step > 1 && std::isfinite(last) && last < 0.8;
    if (speculates) {
      // Applied before the commit, published only by it; the holding job has not moved.
      EXPECT_TRUE(WaitAllMoved(*fast.opt, fast_before));
      for (size_t b = 0; b < sizes.size(); ++b) EXPECT_EQ(fast.opt->steps(b), step - 1u);
      EXPECT_FALSE(AllMoved(*held.opt, held_before));
    }
    if (step == kLrChangedAt) {
      for (auto& h : hyper) h.lr *= 0.5;
      for (size_t g = 0; g < hyper.size(); ++g) {
        ASSERT_TRUE(fast.opt->SetGroup(g, hyper[g]).ok());
        ASSERT_TRUE(held.opt->SetGroup(g, hyper[g]).ok());
      }
    }
    ASSERT_TRUE(fast.opt->Commit().ok());
    ASSERT_TRUE(held.opt->Commit().ok());
    const bool redo = speculates && (coef < 1.0f || step == kLrChangedAt);
    want_speculated += speculates;
    want_redone += redo;
    redone_yet |= redo;
    last = norm;
    for (size_t b = 0; b < sizes.size(); ++b) {
      RefStep(ref[b], acc[b], hyper[group_of[b]], coef);
      EXPECT_EQ(fast.opt->steps(b), static_cast<uint32_t>(step));
      const size_t bytes = sizes[b] * 4;
      EXPECT_EQ(std::memcmp(held.opt->master(b), ref[b].p.data(), bytes), 0) << "bucket " << b;
      if (!redone_yet) {
        EXPECT_EQ(std::memcmp(fast.opt->master(b), ref[b].p.data(), bytes), 0) << "bucket " << b;
      } else if (step < kInfAt) {
        EXPECT_LE(MaxAbsDiff(fast.opt->master(b), ref[b].p), 1e-6) << "bucket " << b;
      }
    }
  }
  // Step 21: norm Inf, coefficient 0: every finite gradient scaled to 0, NaN where the Inf was.
  for (size_t b = 0; b < sizes.size(); ++b) {
    const float* p = fast.opt->master(b);
    size_t nans = 0;
    for (size_t i = 0; i < sizes[b]; ++i) {
      ASSERT_EQ(std::isnan(p[i]), std::isnan(ref[b].p[i])) << "bucket " << b << " element " << i;
      nans += std::isnan(p[i]);
    }
    EXPECT_EQ(nans, b == 1 ? 1u : 0u);
  }
  EXPECT_TRUE(redone_yet);
  const JobStatus::Activity a = ActivityOf(*fast.client, "speculates");
  EXPECT_EQ(a.speculated_commits, want_speculated);
  EXPECT_EQ(a.redone_commits, want_redone);
  EXPECT_GE(want_speculated, 12u);
  EXPECT_EQ(want_redone, 4u);  // steps 4 and 15 bite, 9 changes lr, 21 is Inf
  const JobStatus::Activity h = ActivityOf(*held.client, "holds");
  EXPECT_EQ(h.speculated_commits, 0u);
  EXPECT_EQ(h.redone_commits, 0u);
}

// The commit needs the norm, not the updates: a bucket the next forward needs first is published
// while a large one is still being speculated on (the commit sums that one's squares itself), and
// the large one is applied with the step's hyperparameters even when the trainer writes the next
// step's before it ends. One optimizer thread and an 8M-element bucket make the large update last
// far longer than the small one's commit; the commit used to wait for every update, so before
// this change the small bucket was never published first.
TEST(Speculation, FirstBucketPublishedWhileTheLastIsStillSpeculated) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "384MiB", "--optimizer-threads", "1"}});
  ASSERT_TRUE(d);
  const std::vector<uint64_t> sizes = {1000, uint64_t{8} << 20};  // A (first in forward), B
  constexpr size_t kA = 0, kB = 1;
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1}};
  for (uint64_t n : sizes) spec.buckets.push_back({0, n, DType::kF32, DType::kF32});
  spec.max_grad_norm = 1.0;
  AttachedOptimizer job = AttachOptimizer(*d, "early", spec);
  ASSERT_TRUE(job.opt);
  ASSERT_TRUE(job.opt->SetOrder({kA, kB}).ok());
  std::mt19937 rng(5);
  std::vector<RefParam> ref = RandomRef(sizes, rng);
  for (size_t b = 0; b < sizes.size(); ++b)
    std::memcpy(job.opt->master(b), ref[b].p.data(), sizes[b] * 4);
  const double total_numel = static_cast<double>(sizes[0] + sizes[1]);
  // Norms: 0.3 (no speculation yet), four that do not bite, then 3.0, which bites after a
  // speculation: the large bucket is undone and redone once its speculation ends.
  const std::vector<double> target = {0.3, 0.3, 0.4, 0.3, 0.5, 3.0};
  int published_first = 0, stamped_first = 0;
  uint64_t redone = 0;
  for (int step = 1; step <= static_cast<int>(target.size()); ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    GroupHyper h = spec.groups[0];
    h.lr *= 1.0 + 0.1 * step;
    ASSERT_TRUE(job.opt->SetGroup(0, h).ok());
    const float scale = static_cast<float>(target[step - 1] / std::sqrt(total_numel));
    std::vector<std::vector<float>> grads(sizes.size());
    ASSERT_TRUE(job.opt->Wait(kB).ok());
    // B's chunks run in order: its last ones unchanged mean its speculation has not ended.
    const float* b_tail = job.opt->master(kB) + sizes[kB] - 4096;
    const std::vector<float> tail_before(b_tail, b_tail + 4096);
    for (size_t b : {kB, kA}) {  // backward order
      ASSERT_TRUE(job.opt->Wait(b).ok());
      grads[b] = RandomVec(sizes[b], rng, scale);
      std::memcpy(job.opt->grad(b), grads[b].data(), sizes[b] * 4);
      ASSERT_TRUE(job.opt->Ready(b).ok());
    }
    ASSERT_TRUE(job.opt->Commit(absl::Seconds(600), /*wait=*/false).ok());
    ASSERT_TRUE(job.opt->Wait(kA).ok());
    EXPECT_EQ(job.opt->steps(kA), static_cast<uint32_t>(step));
    if (step > 1) published_first += std::memcmp(b_tail, tail_before.data(), 4096 * 4) == 0;
    // The trainer's scheduler writes the next step's rate while B may still be in flight.
    GroupHyper next = h;
    next.lr *= 7;
    ASSERT_TRUE(job.opt->SetGroup(0, next).ok());
    ASSERT_TRUE(job.opt->WaitCommitted().ok());
    ASSERT_TRUE(job.opt->WaitAll().ok());
    // The control page's stamps of each bucket's step, in order; A published before B's work ended.
    for (size_t b : {kA, kB}) {
      const Optimizer::BucketTimes t = job.opt->times(b);
      EXPECT_GT(t.taken_ns, 0u) << "bucket " << b;
      EXPECT_LE(t.taken_ns, t.began_ns) << "bucket " << b;
      EXPECT_LE(t.began_ns, t.ended_ns) << "bucket " << b;
      EXPECT_LE(t.ended_ns, t.published_ns) << "bucket " << b;
    }
    if (step > 1) stamped_first += job.opt->times(kA).published_ns < job.opt->times(kB).ended_ns;
    const auto [norm, coef] = ClipOf(grads, 1.0);
    redone += step > 1 && coef < 1.0f;
    for (size_t b = 0; b < sizes.size(); ++b) {
      RefStep(ref[b], grads[b], h, coef);
      EXPECT_EQ(job.opt->steps(b), static_cast<uint32_t>(step));
      if (coef == 1.0f) {
        EXPECT_EQ(std::memcmp(job.opt->master(b), ref[b].p.data(), sizes[b] * 4), 0)
            << "bucket " << b;
      } else {
        EXPECT_LE(MaxAbsDiff(job.opt->master(b), ref[b].p), 1e-6) << "bucket " << b;
      }
    }
  }
  // Steps 2 to 6 speculate; B's update (8M elements on one thread) outlasts A's commit in
  // nearly every one of them. Before, never: the commit waited for B's last chunk.
  EXPECT_GE(published_first, 3) << "of 5 steps";
  EXPECT_GE(stamped_first, 3) << "of 5 steps";
  const JobStatus::Activity a = ActivityOf(*job.client, "early");
  EXPECT_EQ(a.speculated_commits, 5u);
  EXPECT_EQ(a.redone_commits, redone);
  EXPECT_EQ(redone, 1u);
}

INSTANTIATE_TEST_SUITE_P(Deliveries, Speculation, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "Accumulated" : "Direct";
                         });

}  // namespace
}  // namespace tsd::testing
