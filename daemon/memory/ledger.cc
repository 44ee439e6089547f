#include "daemon/memory/ledger.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "proto/status_macros.h"
#include "proto/wire.h"

namespace tsd {
namespace {

using wire::FormatBytes;

constexpr size_t kNamed = 3;  // holders a refusal names before "N more"

// "'a' 8 MiB, 'b' 2 MiB, 1 more": the biggest entries of `sizes`, biggest first.
std::string Biggest(std::vector<std::pair<std::string, uint64_t>> sizes) {
  std::sort(sizes.begin(), sizes.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<std::string> parts;
  size_t shown = 0, nonzero = 0;
  for (const auto& [name, bytes] : sizes) {
    if (bytes == 0) continue;
    ++nonzero;
    if (shown < kNamed) {
      parts.push_back(absl::StrCat(name, " ", FormatBytes(bytes)));
      ++shown;
    }
  }
  if (parts.empty()) return "nobody";
  if (nonzero > shown) parts.push_back(absl::StrCat(nonzero - shown, " more"));
  return absl::StrJoin(parts, ", ");
}

}  // namespace

std::string Holder::ToString() const {
  return absl::StrCat(kind == Kind::kJob ? "job '" : "store '", name, "'");
}

// --- Reservation ---------------------------------------------------------------------------

Reservation::~Reservation() {
  if (ledger_ != nullptr) ledger_->Cancel(*this);
}

Reservation::Reservation(Reservation&& other) noexcept
    : ledger_(std::exchange(other.ledger_, nullptr)), id_(other.id_), bytes_(other.bytes_) {}

Reservation& Reservation::operator=(Reservation&& other) noexcept {
  if (this != &other) {
    if (ledger_ != nullptr) ledger_->Cancel(*this);
    ledger_ = std::exchange(other.ledger_, nullptr);
    id_ = other.id_;
    bytes_ = other.bytes_;
  }
  return *this;
}

// --- Ledger --------------------------------------------------------------------------------

Ledger::Ledger(uint64_t pool_bytes, uint64_t store_budget_bytes)
    : pool_bytes_(pool_bytes), store_budget_(store_budget_bytes) {}

Ledger::~Ledger() = default;

absl::Status Ledger::OpenJob(const std::string& name, uint64_t quota_bytes) {
  if (name.empty()) return absl::InvalidArgumentError("a job's name is empty");
  MutexLock lock(mu_);
  const Holder job = Holder::Job(name);
  if (accounts_.count(job) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(job.ToString(), " is already open"));
  }
  accounts_[job].quota = quota_bytes;
  return absl::OkStatus();
}

absl::Status Ledger::SetQuota(const std::string& name, uint64_t quota_bytes) {
  MutexLock lock(mu_);
  const Holder job = Holder::Job(name);
  Account* account = AccountLocked(job, false);
  if (account == nullptr) return absl::NotFoundError(absl::StrCat(job.ToString(), " is not open"));
  if (quota_bytes < account->held()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the new quota of ", job.ToString(), ", ", FormatBytes(quota_bytes), ", is below the ",
        FormatBytes(account->held()), " it holds; free some of it first"));
  }
  account->quota = quota_bytes;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> Ledger::CloseJob(const std::string& name) {
  MutexLock lock(mu_);
  const Holder job = Holder::Job(name);
  auto it = accounts_.find(job);
  if (it == accounts_.end()) {
    return absl::NotFoundError(absl::StrCat(job.ToString(), " is not open"));
  }
  const uint64_t released = it->second.held();
  for (auto p = pending_.begin(); p != pending_.end();) {
    p = p->second.holder == job ? pending_.erase(p) : std::next(p);
  }
  held_ -= released;
  accounts_.erase(it);
  return released;
}

Ledger::Account* Ledger::AccountLocked(const Holder& holder, bool open_store) {
  auto it = accounts_.find(holder);
  if (it != accounts_.end()) return &it->second;
  if (holder.kind == Holder::Kind::kStore && open_store) return &accounts_[holder];
  return nullptr;
}

const Ledger::Account* Ledger::FindLocked(const Holder& holder) const {
  auto it = accounts_.find(holder);
  return it == accounts_.end() ? nullptr : &it->second;
}

void Ledger::DropStoreIfEmptyLocked(const Holder& holder) {
  if (holder.kind != Holder::Kind::kStore) return;
  auto it = accounts_.find(holder);
  if (it != accounts_.end() && it->second.held() == 0) accounts_.erase(it);
}

uint64_t Ledger::StoreHeldLocked() const {
  uint64_t sum = 0;
  for (const auto& [holder, account] : accounts_) {
    if (holder.kind == Holder::Kind::kStore) sum += account.held();
  }
  return sum;
}

std::string Ledger::BiggestHoldersLocked() const {
  std::vector<std::pair<std::string, uint64_t>> sizes;
  for (const auto& [holder, account] : accounts_) {
    sizes.emplace_back(holder.ToString(), account.held());
  }
  return Biggest(std::move(sizes));
}

absl::Status Ledger::CheckFitsLocked(const Holder& holder, const std::string& label,
                                     uint64_t bytes) const {
  const Account* account = FindLocked(holder);  // null for a store with no account yet
  if (account == nullptr && holder.kind == Holder::Kind::kJob) {
    return absl::NotFoundError(absl::StrCat(holder.ToString(), " is not open"));
  }
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("'", label, "' for ", holder.ToString(),
                                                   " asks for 0 bytes; ask for at least 1 byte"));
  }
  if (label.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a charge of ", FormatBytes(bytes), " to ",
                                                   holder.ToString(),
                                                   " has no label; name what the bytes are for"));
  }
  const std::string what = absl::StrCat("'", label, "' (", FormatBytes(bytes), ")");
  const uint64_t held = account == nullptr ? 0 : account->held();
  if (holder.kind == Holder::Kind::kJob) {
    // held <= quota always holds: SetQuota refuses to go below it.
    if (bytes > account->quota - held) {
      std::vector<std::pair<std::string, uint64_t>> labels;
      for (const auto& [l, b] : account->labels) labels.emplace_back(absl::StrCat("'", l, "'"), b);
      if (account->reserved > 0) labels.emplace_back("reservations", account->reserved);
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " would exceed ", holder.ToString(), "'s quota: it holds ", FormatBytes(held),
          " of ", FormatBytes(account->quota), " (", FormatBytes(account->quota - held),
          " free; the biggest: ", Biggest(std::move(labels)),
          "); free some of it, or give the job a larger quota"));
    }
  } else {
    const uint64_t stores = StoreHeldLocked();
    if (bytes > store_budget_ - stores) {
      std::vector<std::pair<std::string, uint64_t>> sizes;
      for (const auto& [h, a] : accounts_) {
        if (h.kind == Holder::Kind::kStore) sizes.emplace_back(h.ToString(), a.held());
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " for ", holder.ToString(), " would exceed the store budget: stores hold ",
          FormatBytes(stores), " of ", FormatBytes(store_budget_), " (",
          FormatBytes(store_budget_ - stores), " free; the biggest: ", Biggest(std::move(sizes)),
          "); release stores, or raise store_budget"));
    }
  }
  if (bytes > pool_bytes_ - held_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, " for ", holder.ToString(),
                     " does not fit in the pool: ", FormatBytes(pool_bytes_ - held_), " free of ",
                     FormatBytes(pool_bytes_), "; held by ", BiggestHoldersLocked()));
  }
  return absl::OkStatus();
}

absl::Status Ledger::Charge(const Holder& holder, const std::string& label, uint64_t bytes) {
  MutexLock lock(mu_);
  TSD_RETURN_IF_ERROR(CheckFitsLocked(holder, label, bytes));
  Account& account = *AccountLocked(holder, true);
  account.charged += bytes;
  account.labels[label] += bytes;
  held_ += bytes;
  return absl::OkStatus();
}

absl::Status Ledger::Uncharge(const Holder& holder, const std::string& label, uint64_t bytes) {
  MutexLock lock(mu_);
  Account* account = AccountLocked(holder, false);
  auto it = account == nullptr ? std::map<std::string, uint64_t>::iterator()
                               : account->labels.find(label);
  if (account == nullptr || it == account->labels.end() || it->second < bytes) {
    const uint64_t has = account == nullptr || it == account->labels.end() ? 0 : it->second;
    return absl::FailedPreconditionError(absl::StrCat("cannot return ", FormatBytes(bytes), " of '",
                                                      label, "' for ", holder.ToString(),
                                                      ": it holds ", FormatBytes(has), " there"));
  }
  it->second -= bytes;
  if (it->second == 0) account->labels.erase(it);
  account->charged -= bytes;
  held_ -= bytes;
  DropStoreIfEmptyLocked(holder);
  return absl::OkStatus();
}

absl::Status Ledger::CheckFits(const Holder& holder, const std::string& label,
                               uint64_t bytes) const {
  MutexLock lock(mu_);
  return CheckFitsLocked(holder, label, bytes);
}

absl::StatusOr<Reservation> Ledger::Reserve(const Holder& holder, const std::string& label,
                                            uint64_t bytes) {
  MutexLock lock(mu_);
  TSD_RETURN_IF_ERROR(CheckFitsLocked(holder, label, bytes));
  Account& account = *AccountLocked(holder, true);
  account.reserved += bytes;
  held_ += bytes;
  const uint64_t id = next_id_++;
  pending_[id] = Pending{holder, label, bytes};
  return Reservation(this, id, bytes);
}

absl::Status Ledger::Commit(Reservation& reservation) {
  if (reservation.ledger_ != this) {
    return absl::FailedPreconditionError(reservation.ledger_ == nullptr
                                             ? "the reservation was already committed or cancelled"
                                             : "the reservation belongs to another ledger");
  }
  reservation.ledger_ = nullptr;  // committed or gone: nothing to cancel later
  MutexLock lock(mu_);
  auto it = pending_.find(reservation.id_);
  if (it == pending_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the reservation of ", FormatBytes(reservation.bytes_),
                     " was dropped: its job was closed meanwhile; free what was allocated"));
  }
  const Pending p = std::move(it->second);
  pending_.erase(it);
  Account& account = *AccountLocked(p.holder, false);
  account.reserved -= p.bytes;
  account.charged += p.bytes;
  account.labels[p.label] += p.bytes;
  return absl::OkStatus();
}

void Ledger::Cancel(Reservation& reservation) {
  if (reservation.ledger_ != this) return;
  reservation.ledger_ = nullptr;
  MutexLock lock(mu_);
  CancelLocked(reservation.id_);
}

void Ledger::CancelLocked(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return;  // its job was closed: already returned
  const Pending p = std::move(it->second);
  pending_.erase(it);
  Account* account = AccountLocked(p.holder, false);
  account->reserved -= p.bytes;
  held_ -= p.bytes;
  DropStoreIfEmptyLocked(p.holder);
}

absl::Status Ledger::SetPoolBytes(uint64_t pool_bytes) {
  MutexLock lock(mu_);
  if (pool_bytes < held_) {
    const bool stores = StoreHeldLocked() > 0;
    return absl::FailedPreconditionError(absl::StrCat(
        "the new pool of ", FormatBytes(pool_bytes), " is smaller than the ", FormatBytes(held_),
        stores ? " jobs and stores hold now (" : " jobs hold now (", BiggestHoldersLocked(),
        "); free memory first or keep a pool of at least ", FormatBytes(held_)));
  }
  pool_bytes_ = pool_bytes;
  return absl::OkStatus();
}

absl::Status Ledger::SetStoreBudget(uint64_t store_budget_bytes) {
  MutexLock lock(mu_);
  const uint64_t stores = StoreHeldLocked();
  if (store_budget_bytes < stores) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the new store budget of ", FormatBytes(store_budget_bytes), " is smaller than the ",
        FormatBytes(stores), " stores hold now; release stores first or keep a budget of at least ",
        FormatBytes(stores)));
  }
  store_budget_ = store_budget_bytes;
  return absl::OkStatus();
}

LedgerView Ledger::View() const {
  MutexLock lock(mu_);
  LedgerView v;
  v.pool_bytes = pool_bytes_;
  v.held_bytes = held_;
  v.store_budget_bytes = store_budget_;
  v.store_held_bytes = StoreHeldLocked();
  for (const auto& [holder, account] : accounts_) {
    v.accounts.push_back({holder, account.quota, account.charged, account.reserved});
  }
  return v;
}

uint64_t Ledger::Held(const Holder& holder) const {
  MutexLock lock(mu_);
  const Account* account = FindLocked(holder);
  return account == nullptr ? 0 : account->held();
}

}  // namespace tsd
