// NUMA placement: the sysfs topology parser against a fake tree (two nodes, PCI devices on each,
// broken files), the choice of a GPU's node and the node-less fallbacks, the worker pool split by
// node, regions allocated under a node's memory policy, and the registry placing a job. The GPU
// machine and CI have one node, so the two-node cases run against a fake sysfs; the real /sys is
// checked to parse.
#include <sched.h>
#include <unistd.h>

#include <linux/mempolicy.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/jobs/registry.h"
#include "daemon/memory/cpu_affinity.h"
#include "daemon/memory/numa_memory.h"
#include "daemon/memory/numa_topology.h"
#include "daemon/memory/region.h"
#include "daemon/optimizer/worker_pool.h"

namespace tsd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

namespace fs = std::filesystem;

// A sysfs tree in a fresh temporary directory, removed with the object.
class FakeSysfs {
 public:
  FakeSysfs() {
    char tmpl[] = "/tmp/tsd-numa-XXXXXX";
    root_ = mkdtemp(tmpl);
  }
  ~FakeSysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  const std::string& root() const { return root_; }
  void Write(const std::string& rel, const std::string& text) const {
    const fs::path p = fs::path(root_) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  void Node(int id, const std::string& cpulist) const {
    Write("devices/system/node/node" + std::to_string(id) + "/cpulist", cpulist);
  }
  void Device(const std::string& bus_id, const std::string& numa_node) const {
    Write("bus/pci/devices/" + bus_id + "/numa_node", numa_node);
  }
  // Two nodes of four CPUs, a GPU on each, and the kernel's usual extra entries.
  void TwoNodes() const {
    Node(0, "0-3\n");
    Node(1, "4-7\n");
    Write("devices/system/node/online", "0-1\n");
    Write("devices/system/node/possible", "0-1\n");
    Write("devices/system/node/power/async", "disabled\n");
    Device("0000:c1:00.0", "1\n");
    Device("0000:01:00.0", "0\n");
  }

 private:
  std::string root_;
};

TEST(ParseCpuList, ReadsIdsAndRanges) {
  auto cpus = ParseCpuList("0-3,8,10-11\n", 64);
  ASSERT_TRUE(cpus.ok()) << cpus.status();
  EXPECT_THAT(*cpus, ElementsAre(0, 1, 2, 3, 8, 10, 11));
  EXPECT_THAT(*ParseCpuList("\n", 64), IsEmpty());  // a memory-only node
  EXPECT_THAT(*ParseCpuList("5,1-2,2", 64), ElementsAre(1, 2, 5));
}

TEST(ParseCpuList, RefusesWhatIsNotAList) {
  for (const char* bad : {"a", "3-1", "1-", "-1", "0,,1", "0-2:2", "1 2", "64", "0-99999999999"}) {
    auto cpus = ParseCpuList(bad, 64);
    EXPECT_EQ(cpus.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(cpus.status().message(), HasSubstr("is not a list of CPU ids")) << bad;
  }
}

TEST(CanonicalPciBusId, RewritesValidAddresses) {
  EXPECT_EQ(*CanonicalPciBusId("0000:c1:00.0"), "0000:c1:00.0");
  EXPECT_EQ(*CanonicalPciBusId("0000:C1:00.0"), "0000:c1:00.0");
  EXPECT_EQ(*CanonicalPciBusId("00000000:C1:00.0"), "0000:c1:00.0");  // nvidia-smi's form
  EXPECT_EQ(*CanonicalPciBusId("10000:01:1f.7"), "10000:01:1f.7");    // a VMD domain
}

TEST(CanonicalPciBusId, RefusesAnythingElseBeforeItBecomesAPath) {
  for (const char* bad :
       {"", "../../../etc/passwd", "0000:c1:00", "c1:00.0", "0000:c1:00.8", "0000:c1:0.0",
        "0000:zz:00.0", "0000:c1:00.0/../x", "0000:c1:20.0", "000000000:c1:00.0", "0000:c1:00.0 ",
        "0000:c1:00.0\n", "0000:c1:00.00"}) {
    auto id = CanonicalPciBusId(bad);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(id.status().message(), HasSubstr("DOMAIN:BUS:DEVICE.FUNCTION")) << bad;
  }
}

TEST(NumaTopology, ParsesAFakeTwoNodeTree) {
  FakeSysfs sys;
  sys.TwoNodes();
  auto t = NumaTopology::Load(sys.root());
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->nodes().size(), 2u);
  EXPECT_TRUE(t->multi_node());
  EXPECT_EQ(t->nodes()[0].id, 0);
  EXPECT_THAT(t->nodes()[0].cpus, ElementsAre(0, 1, 2, 3));
  EXPECT_EQ(t->nodes()[1].id, 1);
  EXPECT_THAT(t->nodes()[1].cpus, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(t->Describe(), "0:0-3 1:4-7");
  EXPECT_EQ(t->FindNode(2), nullptr);
}

TEST(NumaTopology, ChoosesTheNodeOfTheGpu) {
  FakeSysfs sys;
  sys.TwoNodes();
  auto t = NumaTopology::Load(sys.root());
  ASSERT_TRUE(t.ok()) << t.status();
  auto gpu1 = t->PlaceDevice("0000:C1:00.0");  // upper case, as some tools print it
  ASSERT_TRUE(gpu1.ok()) << gpu1.status();
  EXPECT_EQ(gpu1->node, 1);
  EXPECT_EQ(gpu1->reason, "");
  EXPECT_EQ(t->PlaceDevice("00000000:01:00.0")->node, 0);
  // No GPU: no node, and nothing to complain about.
  EXPECT_EQ(t->PlaceDevice("")->node, -1);
  EXPECT_EQ(t->PlaceDevice("")->reason, "");
}

TEST(NumaTopology, FallsBackToNoNodeSayingWhy) {
  FakeSysfs sys;
  sys.TwoNodes();
  sys.Device("0000:02:00.0", "-1\n");                            // the kernel knows no node for it
  sys.Device("0000:03:00.0", "garbage\n");                       // malformed
  sys.Device("0000:04:00.0", "5\n");                             // a node this host does not have
  sys.Write("bus/pci/devices/0000:05:00.0/vendor", "0x10de\n");  // no numa_node file
  auto t = NumaTopology::Load(sys.root());
  ASSERT_TRUE(t.ok()) << t.status();
  const struct {
    const char* id;
    const char* why;
  } cases[] = {{"0000:02:00.0", "reports no NUMA node"},
               {"0000:03:00.0", "not a node number"},
               {"0000:04:00.0", "on node 5, which is not among this host's nodes (0:0-3 1:4-7)"},
               {"0000:05:00.0", "cannot read"},
               {"0000:99:00.0", "cannot read"}};
  for (const auto& c : cases) {
    auto p = t->PlaceDevice(c.id);
    ASSERT_TRUE(p.ok()) << c.id << ": " << p.status();
    EXPECT_EQ(p->node, -1) << c.id;
    EXPECT_THAT(p->reason, HasSubstr(c.why)) << c.id;
  }
  // A malformed address is the client's error, never a path.
  auto bad = t->PlaceDevice("../../../../etc");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NumaTopology, RefusesBrokenTrees) {
  {
    FakeSysfs sys;  // no devices/system/node at all: a kernel without NUMA, or a container
    auto t = NumaTopology::Load(sys.root());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(t.status().message(), HasSubstr("no NUMA nodes listed"));
  }
  {
    FakeSysfs sys;  // the directory, but no node in it
    sys.Write("devices/system/node/online", "\n");
    EXPECT_EQ(NumaTopology::Load(sys.root()).status().code(), absl::StatusCode::kNotFound);
  }
  {
    FakeSysfs sys;  // a node without its cpulist
    sys.Node(0, "0-3\n");
    sys.Write("devices/system/node/node1/meminfo", "\n");
    auto t = NumaTopology::Load(sys.root());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(t.status().message(), HasSubstr("node1/cpulist"));
  }
  {
    FakeSysfs sys;  // a malformed cpulist
    sys.Node(0, "0-3\n");
    sys.Node(1, "4-x\n");
    auto t = NumaTopology::Load(sys.root());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(t.status().message(), HasSubstr("node1/cpulist"));
  }
  {
    FakeSysfs sys;  // an oversized file
    sys.Node(0, std::string(100 * 1024, '0'));
    EXPECT_EQ(NumaTopology::Load(sys.root()).status().code(), absl::StatusCode::kDataLoss);
  }
}

TEST(NumaTopology, OneNodeMeansNoPlacement) {
  FakeSysfs sys;
  sys.Node(0, "0-7\n");
  sys.Device("0000:c1:00.0", "0\n");
  auto t = NumaTopology::Load(sys.root());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_FALSE(t->multi_node());
}

// This machine's own sysfs parses; on a host of one node (CI, the GPU machine) that node holds
// every CPU this process may run on.
TEST(NumaTopology, TheRealSysfsParses) {
  if (!fs::exists("/sys/devices/system/node")) GTEST_SKIP() << "no /sys/devices/system/node here";
  auto t = NumaTopology::Load("/sys");
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_GE(t->nodes().size(), 1u);
  if (t->nodes().size() != 1) GTEST_SKIP() << "a host of " << t->nodes().size() << " nodes";
  EXPECT_FALSE(t->multi_node());
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const std::set<int> cpus(t->nodes()[0].cpus.begin(), t->nodes()[0].cpus.end());
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) {
      EXPECT_EQ(cpus.count(c), 1u) << "CPU " << c;
    }
  }
}

// AllowedCpus reads this thread's affinity, which a taskset or cpuset narrows: the workers'
// count, the populate threads and NUMA placement all size themselves by it.
TEST(CpuAffinity, FollowsTheThreadsMask) {
  const std::vector<int> all = AllowedCpus();
  ASSERT_FALSE(all.empty());
  EXPECT_TRUE(std::is_sorted(all.begin(), all.end()));
  EXPECT_EQ(AllowedCpuCount(), static_cast<int>(all.size()));
  std::thread([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(all.back(), &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    EXPECT_THAT(AllowedCpus(), ElementsAre(all.back()));
    EXPECT_EQ(AllowedCpuCount(), 1);
  }).join();
  EXPECT_EQ(AllowedCpus(), all);  // another thread's mask is its own
}

TEST(WorkerPoolNuma, SplitsWorkersByNodeInProportionToCpus) {
  // The CPU ids need not exist for the split (affinity to absent CPUs is refused and ignored).
  WorkerPool pool(8, false, 0, {{0, {0, 1, 2, 3, 4, 5}}, {1, {6, 7}}});
  EXPECT_THAT(pool.worker_nodes(), ElementsAre(0, 0, 0, 0, 0, 0, 1, 1));
  EXPECT_TRUE(pool.ServesNode(1));
  EXPECT_FALSE(pool.ServesNode(2));
  // Every node gets a worker even when there are fewer threads than nodes.
  WorkerPool few(1, false, 0, {{0, {0, 1, 2}}, {1, {3}}});
  EXPECT_THAT(few.worker_nodes(), ElementsAre(0, 1));
  // A node without CPUs (memory only) gets none; one node with CPUs left: not split.
  WorkerPool one(2, false, 0, {{0, {0, 1}}, {1, {}}});
  EXPECT_THAT(one.worker_nodes(), ElementsAre(-1, -1));
  EXPECT_FALSE(one.ServesNode(0));
  WorkerPool none(3, false);
  EXPECT_THAT(none.worker_nodes(), ElementsAre(-1, -1, -1));
}

TEST(WorkerPoolNuma, ANodesQueueRunsOnlyOnThatNodesCpus) {
  const std::vector<int> cpus = tsd::AllowedCpus();
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs";
  const int a = cpus[0], b = cpus[1];
  WorkerPool pool(4, false, 0, {{0, {a}}, {1, {b}}});
  std::mutex mu;
  std::vector<std::vector<int>> seen_node1, seen_any;
  std::atomic<int> left{0};
  auto on_node1 = pool.NewQueue(1), anywhere = pool.NewQueue(-1), unknown = pool.NewQueue(7);
  std::vector<std::function<void()>> t1, t_any;
  for (int i = 0; i < 40; ++i) {
    t1.push_back([&] {
      std::lock_guard<std::mutex> l(mu);
      seen_node1.push_back(tsd::AllowedCpus());
      --left;
    });
    t_any.push_back([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      std::lock_guard<std::mutex> l(mu);
      seen_any.push_back(tsd::AllowedCpus());
      --left;
    });
  }
  left = 80;
  pool.Submit(on_node1, std::move(t1));
  pool.Submit(anywhere, std::move(t_any));
  // A queue for a node the pool does not serve runs anywhere (here: at all).
  std::atomic<bool> ran{false};
  pool.Submit(unknown, {[&] { ran = true; }});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while ((left.load() > 0 || !ran.load()) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(left.load(), 0);
  EXPECT_TRUE(ran.load());
  for (const auto& s : seen_node1) EXPECT_THAT(s, ElementsAre(b));
  std::set<std::vector<int>> any_cpus(seen_any.begin(), seen_any.end());
  for (const auto& s : any_cpus) EXPECT_TRUE(s == std::vector<int>{a} || s == std::vector<int>{b});
  // The dispatcher's pinning: the calling thread confined to node 1's CPUs, then back.
  std::thread([&] {
    pool.PinCurrentThreadToNode(1);
    EXPECT_THAT(tsd::AllowedCpus(), ElementsAre(b));
  }).join();
  std::thread([&] {
    const std::vector<int> before = tsd::AllowedCpus();
    pool.PinCurrentThreadToNode(7);  // not served: unchanged
    EXPECT_EQ(tsd::AllowedCpus(), before);
  }).join();
}

TEST(NumaMemory, ARegionOnANodeHasItsPagesThereAndTheThreadPolicyIsRestored) {
  ASSERT_EQ(*ThreadMemoryPolicyMode(), MPOL_DEFAULT);
  auto r = Region::Create(1, "placed", 1 << 20, /*lock=*/false, /*numa_node=*/0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->numa_node(), 0);
  EXPECT_EQ((*r)->numa_error(), "");
  for (size_t off = 0; off < (1u << 20); off += 4096) {
    auto node = NodeOfPage(static_cast<char*>((*r)->data()) + off);
    ASSERT_TRUE(node.ok()) << node.status();
    ASSERT_EQ(*node, 0) << "page at " << off;
  }
  EXPECT_EQ(*ThreadMemoryPolicyMode(), MPOL_DEFAULT);
}

TEST(NumaMemory, ANodeTheKernelRefusesLeavesTheRegionUnplaced) {
  // A fake topology can name a node this kernel lacks: the region is made anyway, unplaced.
  auto r = Region::Create(2, "unplaced", 1 << 16, false, /*numa_node=*/1000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->numa_node(), -1);
  EXPECT_THAT((*r)->numa_error(), HasSubstr("refused to prefer NUMA node 1000"));
  EXPECT_EQ(*ThreadMemoryPolicyMode(), MPOL_DEFAULT);
  // No node asked: nothing is touched.
  auto plain = Region::Create(3, "plain", 1 << 16, false);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->numa_node(), -1);
  EXPECT_EQ((*plain)->numa_error(), "");
}

class RegistryNumaTest : public ::testing::Test {
 protected:
  std::unique_ptr<Registry> Make(const NumaTopology* numa) {
    RegistryOptions o;
    o.pool_bytes = 64 << 20;
    o.max_job_quota_bytes = 64 << 20;
    o.numa = numa;
    return std::make_unique<Registry>(o);
  }
  static int NodeOf(const Registry& r, const std::string& job) {
    for (const auto& j : r.Jobs()) {
      if (j.name() == job) return j.has_numa_node() ? j.numa_node() : -1;
    }
    return -2;
  }
};

TEST_F(RegistryNumaTest, AJobGoesToItsGpusNodeAndTheFirstGpuDecides) {
  FakeSysfs sys;
  sys.TwoNodes();
  auto t = NumaTopology::Load(sys.root());
  ASSERT_TRUE(t.ok()) << t.status();
  auto reg = Make(&*t);
  auto s = reg->Attach("train", 0, getuid(), getpid());
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(NodeOf(*reg, "train"), -1);
  // A malformed address is refused and places nothing.
  auto bad = reg->PlaceJob(s->session_id, "0000:c1:00.0;rm");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NodeOf(*reg, "train"), -1);
  // Unknown to sysfs: unplaced (the daemon logs why).
  EXPECT_EQ(*reg->PlaceJob(s->session_id, "0000:77:00.0"), -1);
  EXPECT_EQ(*reg->PlaceJob(s->session_id, "0000:c1:00.0"), 1);
  EXPECT_EQ(NodeOf(*reg, "train"), 1);
  EXPECT_EQ(*reg->PlaceJob(s->session_id, "0000:01:00.0"), 1);  // a second GPU: still node 1
  // Regions allocated from now on ask for node 1; this kernel may lack it, and then they are
  // made unplaced rather than refused.
  auto region = reg->Alloc(s->session_id, "acts", 1 << 20);
  EXPECT_TRUE(region.ok()) << region.status();
  // Another job, with no GPU: unplaced.
  auto cpu = reg->Attach("cpu-only", 0, getuid(), getpid());
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(*reg->PlaceJob(cpu->session_id, ""), -1);
  EXPECT_EQ(NodeOf(*reg, "cpu-only"), -1);
}

TEST_F(RegistryNumaTest, OneNodeOrNoTopologyPlacesNothingButStillChecksTheAddress) {
  FakeSysfs sys;
  sys.Node(0, "0-7\n");
  sys.Device("0000:c1:00.0", "0\n");
  auto one = NumaTopology::Load(sys.root());
  ASSERT_TRUE(one.ok());
  for (const NumaTopology* numa : std::vector<const NumaTopology*>{&*one, nullptr}) {
    auto reg = Make(numa);
    auto s = reg->Attach("train", 0, getuid(), getpid());
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(*reg->PlaceJob(s->session_id, "0000:c1:00.0"), -1);
    EXPECT_EQ(NodeOf(*reg, "train"), -1);
    EXPECT_EQ(reg->PlaceJob(s->session_id, "c1").status().code(),
              absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace tsd
