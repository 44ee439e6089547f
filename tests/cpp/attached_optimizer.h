// A client attached to a job of a real daemon with its optimizer registered: the setup of every
// test that drives the optimizer through the client library (optimizer, speculation and retire
// tests). Failures are reported as test failures; `opt` is null when registration failed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include <gtest/gtest.h>

#include "daemon_process.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {

struct AttachedOptimizer {
  std::unique_ptr<tsd::Client> client;
  std::unique_ptr<Optimizer> opt;
};

inline AttachedOptimizer AttachOptimizer(DaemonProcess& d, const std::string& job,
                                         const OptimizerSpec& spec, uint64_t quota = 0) {
  AttachedOptimizer s;
  s.client = d.Connect();
  EXPECT_TRUE(s.client->Attach(job, quota).ok());
  auto opt = s.client->RegisterOptimizer(spec);
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (opt.ok()) s.opt = std::move(*opt);
  return s;
}

}  // namespace tsd::testing
