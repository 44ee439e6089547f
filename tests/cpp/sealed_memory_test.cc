// SealedMemory's read-only view: what the daemon reads a sealed store through (a device copy's
// source). Before it existed, the device copy read `data()`, which is null once sealed.
#include "daemon/stores/sealed_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "gtest/gtest.h"

namespace tsd::stores {
namespace {

TEST(SealedMemory, ASealedStoreIsReadThroughAReadOnlyViewOnly) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  auto m = SealedMemory::Create(2 * page, "tsd-test-store");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE((*m)->MapReadOnly().ok()) << "nothing is handed out before the seal";
  for (uint64_t i = 0; i < 2 * page; ++i) (*m)->data()[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_TRUE((*m)->Seal(/*lock=*/false).ok());
  EXPECT_EQ((*m)->data(), nullptr) << "the writable mapping goes with the seal";
  auto view = (*m)->MapReadOnly();
  ASSERT_TRUE(view.ok()) << view.status();
  for (uint64_t i = 0; i < 2 * page; ++i) {
    ASSERT_EQ((*view)->data()[i], static_cast<uint8_t>(i * 7 + 1)) << i;
  }
  // The view can never become writable.
  void* at = const_cast<uint8_t*>((*view)->data());
  EXPECT_NE(mprotect(at, page, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(errno, EACCES);
  // Two views at once, each unmapped on its own.
  auto second = (*m)->MapReadOnly();
  ASSERT_TRUE(second.ok());
  view->reset();
  EXPECT_EQ((*second)->data()[1], static_cast<uint8_t>(8));
}

}  // namespace
}  // namespace tsd::stores
