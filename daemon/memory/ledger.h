// The Ledger is the daemon's one book of host-memory bytes: every byte lent goes through it. It
// knows the pool's capacity, each job's quota and what the job holds, and a node budget for
// shared stores (`store_budget`: stores are charged to the pool and to that budget, never to a
// job's quota). A charge is refused, with RESOURCE_EXHAUSTED, when it would overrun the holder's
// quota (or the store budget) or the pool; the refusal says what was asked, what is free, and
// names the biggest holders (a job's own biggest charges when its quota is full, the biggest jobs
// and stores when the pool is), so an operator knows whom to ask. A refusal changes nothing.
//
// Allocating memory is slow (pages are populated and locked), so a charge may be taken in two
// steps: Reserve counts the bytes at once (against the quota and the pool, so concurrent requests
// cannot overcommit), the caller allocates outside its own locks, then Commit turns the
// reservation into a charge, or dropping the Reservation returns the bytes. Closing a job drops
// everything it holds, reservations included: a Reservation of a closed job commits nothing.
//
// Every charge carries a label (a region's name), so a job's holdings can be named and an
// Uncharge must match what was charged under that label.
//
// Thread safety: every method may be called from any thread (one mutex, held briefly).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/mutex.h"

namespace tsd {

class Ledger;

// Who holds bytes: a job (with a quota) or a shared store (under the node's store budget).
struct Holder {
  enum class Kind { kJob, kStore };
  Kind kind = Kind::kJob;
  std::string name;

  static Holder Job(std::string name) { return {Kind::kJob, std::move(name)}; }
  static Holder Store(std::string name) { return {Kind::kStore, std::move(name)}; }
  // "job 'a'", "store 'weights'".
  std::string ToString() const;
  auto operator<=>(const Holder&) const = default;
};

// Bytes counted for a holder but not yet committed (see Ledger::Reserve). Move-only; destroying
// it uncommitted returns the bytes.
class Reservation {
 public:
  Reservation() = default;
  ~Reservation();
  Reservation(Reservation&& other) noexcept;
  Reservation& operator=(Reservation&& other) noexcept;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  uint64_t bytes() const { return bytes_; }
  // True until committed or cancelled.
  bool pending() const { return ledger_ != nullptr; }

 private:
  friend class Ledger;
  Reservation(Ledger* ledger, uint64_t id, uint64_t bytes)
      : ledger_(ledger), id_(id), bytes_(bytes) {}
  Ledger* ledger_ = nullptr;
  uint64_t id_ = 0;
  uint64_t bytes_ = 0;
};

// What the ledger holds, for status, metrics and tests.
struct LedgerView {
  struct Account {
    Holder holder;
    uint64_t quota_bytes = 0;     // jobs only (stores: 0)
    uint64_t charged_bytes = 0;   // committed charges
    uint64_t reserved_bytes = 0;  // reservations not yet committed
    uint64_t held_bytes() const { return charged_bytes + reserved_bytes; }
    bool operator==(const Account&) const = default;
  };
  uint64_t pool_bytes = 0;
  uint64_t held_bytes = 0;  // charged and reserved, every holder
  uint64_t store_budget_bytes = 0;
  uint64_t store_held_bytes = 0;
  std::vector<Account> accounts;  // jobs, then stores, each by name
  uint64_t free_bytes() const { return pool_bytes - held_bytes; }
  bool operator==(const LedgerView&) const = default;
};

class Ledger final {
 public:
  Ledger(uint64_t pool_bytes, uint64_t store_budget_bytes);
  ~Ledger();
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // --- Jobs ---
  // Opens job `name` with a quota. ALREADY_EXISTS when it is open; INVALID_ARGUMENT for an empty
  // name.
  absl::Status OpenJob(const std::string& name, uint64_t quota_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Changes a job's quota; refused (FAILED_PRECONDITION) below what it holds.
  absl::Status SetQuota(const std::string& name, uint64_t quota_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops everything the job holds (its reservations commit nothing afterwards) and forgets it.
  // Returns the bytes released; NOT_FOUND when it is not open.
  absl::StatusOr<uint64_t> CloseJob(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);

  // --- Charges (a store's account is opened by its first charge and closed when it is empty) ---
  // Charges `bytes` (at least 1) to `holder` under `label`.
  absl::Status Charge(const Holder& holder, const std::string& label, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns `bytes` charged to `holder` under `label`; refused, changing nothing, when that is
  // more than the label holds.
  absl::Status Uncharge(const Holder& holder, const std::string& label, uint64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Counts `bytes` for `holder` now (refused like Charge), to be committed under `label`.
  absl::StatusOr<Reservation> Reserve(const Holder& holder, const std::string& label,
                                      uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Turns the reservation into a charge. FAILED_PRECONDITION when it is not pending, or its job
  // was closed meanwhile (then nothing is charged: the caller frees what it allocated).
  absl::Status Commit(Reservation& reservation) ABSL_LOCKS_EXCLUDED(mu_);
  // Returns a pending reservation's bytes (what destroying it does).
  void Cancel(Reservation& reservation) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `bytes` more would fit `holder`'s limit and the pool now, refused as Charge would
  // refuse them; charges nothing (a check before a multi-part charge, such as an optimizer's).
  absl::Status CheckFits(const Holder& holder, const std::string& label, uint64_t bytes) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // --- The node ---
  // Resizes the pool; refused (FAILED_PRECONDITION, naming the holders) below what is held.
  absl::Status SetPoolBytes(uint64_t pool_bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // Resizes the store budget; refused (FAILED_PRECONDITION) below what stores hold.
  absl::Status SetStoreBudget(uint64_t store_budget_bytes) ABSL_LOCKS_EXCLUDED(mu_);

  LedgerView View() const ABSL_LOCKS_EXCLUDED(mu_);
  // What `holder` holds (charged and reserved); 0 when it holds nothing.
  uint64_t Held(const Holder& holder) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Account {
    uint64_t quota = 0;  // jobs only
    uint64_t charged = 0;
    uint64_t reserved = 0;
    std::map<std::string, uint64_t> labels;  // committed charges by label
    uint64_t held() const { return charged + reserved; }
  };
  struct Pending {
    Holder holder;
    std::string label;
    uint64_t bytes = 0;
  };

  // Checks that the holder is open (a job) and that `bytes` more fit its limit and the pool.
  absl::Status CheckFitsLocked(const Holder& holder, const std::string& label, uint64_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The account of `holder`, opening a store's; null for a job that is not open.
  Account* AccountLocked(const Holder& holder, bool open_store) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Account* FindLocked(const Holder& holder) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropStoreIfEmptyLocked(const Holder& holder) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CancelLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // "job 'a' 6 MiB, store 'w' 2 MiB, 3 more": the biggest holders of the pool.
  std::string BiggestHoldersLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t StoreHeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable Mutex mu_;
  uint64_t pool_bytes_ ABSL_GUARDED_BY(mu_);
  uint64_t store_budget_ ABSL_GUARDED_BY(mu_);
  uint64_t held_ ABSL_GUARDED_BY(mu_) = 0;  // every account's charged + reserved
  std::map<Holder, Account> accounts_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace tsd
