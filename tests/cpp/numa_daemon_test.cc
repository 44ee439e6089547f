// NUMA placement end to end: a real tsd reading a fake two-node sysfs (one CPU of this machine per
// node, a GPU on node 1) places a job that names that GPU on node 1: its worker threads run on
// node 1's CPU, `tsctl jobs --json` shows the node, and its updates equal an unplaced job's bit for
// bit. A malformed bus id is refused and changes nothing; without a usable topology nothing is
// placed.
#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/memory/cpu_affinity.h"
#include "daemon_process.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// A fake sysfs: node 0 with CPU `a`, node 1 with CPU `b`, a GPU at 0000:c1:00.0 on node 1.
std::string MakeFakeSysfs(int a, int b) {
  char tmpl[] = "/tmp/tsd-sysfs-XXXXXX";
  const std::string root = mkdtemp(tmpl);
  auto write = [&](const std::string& rel, const std::string& text) {
    fs::create_directories((fs::path(root) / rel).parent_path());
    std::ofstream(fs::path(root) / rel) << text;
  };
  write("devices/system/node/node0/cpulist", std::to_string(a) + "\n");
  write("devices/system/node/node1/cpulist", std::to_string(b) + "\n");
  write("bus/pci/devices/0000:c1:00.0/numa_node", "1\n");
  return root;
}

// The CPU lists of the daemon's threads ("Cpus_allowed_list" of each task).
std::multiset<std::string> ThreadCpuLists(pid_t pid) {
  std::multiset<std::string> out;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  for (const auto& e : fs::directory_iterator(dir)) {
    std::ifstream f(e.path() / "status");
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("Cpus_allowed_list:", 0) == 0) {
        std::string v = line.substr(std::strlen("Cpus_allowed_list:"));
        v.erase(0, v.find_first_not_of(" \t"));
        out.insert(v);
      }
    }
  }
  return out;
}

OptimizerSpec Spec(const std::string& bus_id) {
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1}};
  spec.buckets = {{0, 700001, DType::kF32, DType::kF32}, {0, 1000, DType::kF32, DType::kF32}};
  spec.pci_bus_id = bus_id;
  return spec;
}

// Three steps of the same gradients; returns the masters.
std::vector<std::vector<float>> Train(Optimizer& opt) {
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0, 1);
  std::vector<std::vector<float>> out(opt.num_buckets());
  for (size_t b = 0; b < opt.num_buckets(); ++b) {
    for (uint64_t i = 0; i < opt.numel(b); ++i) opt.master(b)[i] = d(rng);
  }
  for (int step = 0; step < 3; ++step) {
    for (size_t b = 0; b < opt.num_buckets(); ++b) {
      EXPECT_TRUE(opt.Wait(b).ok());
      for (uint64_t i = 0; i < opt.numel(b); ++i) static_cast<float*>(opt.grad(b))[i] = d(rng);
      EXPECT_TRUE(opt.Ready(b).ok());
    }
  }
  for (size_t b = 0; b < opt.num_buckets(); ++b) {
    EXPECT_TRUE(opt.Wait(b).ok());
    out[b].assign(opt.master(b), opt.master(b) + opt.numel(b));
  }
  return out;
}

int NodeOf(tsd::Client& c, const std::string& job) {
  auto jobs = c.Jobs();
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  for (const auto& j : *jobs) {
    if (j.name == job) return j.numa_node;
  }
  return -2;
}

TEST(NumaDaemon, AJobIsPlacedOnItsGpusNode) {
  const std::vector<int> cpus = tsd::AllowedCpus();
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs";
  const std::string sysfs = MakeFakeSysfs(cpus[0], cpus[1]);
  auto d = DaemonProcess::Start(
      {.args = {"--pool-size", "256MiB", "--optimizer-threads", "2", "--sysfs-root", sysfs}});
  ASSERT_TRUE(d);
  EXPECT_THAT(d->log(), HasSubstr("event=numa placement=on"));
  // The workers: one on each node's CPU.
  const auto lists = ThreadCpuLists(d->pid());
  EXPECT_GE(lists.count(std::to_string(cpus[0])), 1u);
  EXPECT_GE(lists.count(std::to_string(cpus[1])), 1u);

  auto placed = d->Connect();
  ASSERT_TRUE(placed->Attach("placed").ok());
  // A malformed address: refused, nothing registered, and the job is still unplaced.
  auto bad = placed->RegisterOptimizer(Spec("0000:c1:00.0/../../x"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("DOMAIN:BUS:DEVICE.FUNCTION"));
  EXPECT_EQ(NodeOf(*placed, "placed"), -1);
  auto opt = placed->RegisterOptimizer(Spec("0000:C1:00.0"));
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_EQ(NodeOf(*placed, "placed"), 1);
  EXPECT_THAT(d->log(),
              HasSubstr("event=numa_placed job=placed pci_bus_id=0000:C1:00.0 numa_node=1"));

  auto plain = d->Connect();
  ASSERT_TRUE(plain->Attach("plain").ok());
  auto plain_opt = plain->RegisterOptimizer(Spec(""));
  ASSERT_TRUE(plain_opt.ok()) << plain_opt.status();
  EXPECT_EQ(NodeOf(*plain, "plain"), -1);

  // The placed job's updates (on node 1's worker only) equal the unplaced one's, bit for bit.
  const auto a = Train(**opt);
  const auto b = Train(**plain_opt);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].size(), b[i].size());
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4), 0) << "bucket " << i;
  }

  int rc = -1;
  const std::string out =
      RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() + " jobs --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  const auto jobs = nlohmann::json::parse(out);
  std::set<std::string> seen;
  for (const auto& j : jobs) {
    seen.insert(j["name"].get<std::string>());
    if (j["name"] == "placed") {
      EXPECT_EQ(j["numa_node"], 1);
    }
    if (j["name"] == "plain") {
      EXPECT_TRUE(j["numa_node"].is_null());
    }
  }
  EXPECT_EQ(seen, (std::set<std::string>{"placed", "plain"}));
  std::error_code ec;
  fs::remove_all(sysfs, ec);
}

TEST(NumaDaemon, WithoutAUsableTopologyNothingIsPlaced) {
  for (const std::string& root : {std::string("/nonexistent-sysfs"), std::string("/sys")}) {
    auto d = DaemonProcess::Start({.args = {"--pool-size", "256MiB", "--sysfs-root", root}});
    ASSERT_TRUE(d);
    if (root == "/sys" && d->log().find("placement=on") != std::string::npos) {
      continue;  // a host of several nodes: placement is the point there
    }
    EXPECT_THAT(d->log(), HasSubstr("event=numa placement=off"));
    auto c = d->Connect();
    ASSERT_TRUE(c->Attach("job").ok());
    // A well-formed address is accepted and places nothing; a malformed one is still refused.
    EXPECT_EQ(c->RegisterOptimizer(Spec("zz")).status().code(), absl::StatusCode::kInvalidArgument);
    auto opt = c->RegisterOptimizer(Spec("0000:c1:00.0"));
    ASSERT_TRUE(opt.ok()) << opt.status();
    EXPECT_EQ(NodeOf(*c, "job"), -1);
  }
}

}  // namespace
}  // namespace tsd::testing
