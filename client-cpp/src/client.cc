#include "tsd/client.h"

#include "tsd/optimizer.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "cuda_host.h"
#include "proto/status_convert.h"
#include "proto/tsd.grpc.pb.h"
#include "proto/wire.h"

namespace tsd {
namespace {

constexpr auto kControlDeadline = std::chrono::seconds(60);  // allocations populate memory
constexpr int kSideReplyTimeoutMs = 30000;

std::string HowToStart(const std::string& path) {
  return absl::StrCat(
      "start it with `tsd --socket ", path,
      "` (or `systemctl start tsd` for the system service), or point TSD_SOCKET at the "
      "socket of a running tsd");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Region

Region::~Region() { Unmap(); }

void Region::Unmap() {
  if (data_ != nullptr) {
    if (cuda_registered_) cuda_host::Unregister(data_);
    munmap(data_, desc_.size);
    data_ = nullptr;
    cuda_registered_ = false;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Client

struct Client::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Tsd::Stub> stub;

  mutable std::mutex mu;
  bool attached ABSL_GUARDED_BY(mu) = false;
  v1::SessionRef session ABSL_GUARDED_BY(mu);
  std::string job ABSL_GUARDED_BY(mu);
  uint64_t quota_bytes ABSL_GUARDED_BY(mu) = 0;
  int side_fd ABSL_GUARDED_BY(mu) = -1;
  std::string notice ABSL_GUARDED_BY(mu);  // what the daemon said when it closed on us

  ~Impl() {
    if (side_fd >= 0) close(side_fd);
  }

  // Reads one reply from the side socket, waiting up to the timeout. A notice (e.g. shutdown)
  // becomes an error carrying the daemon's words.
  absl::StatusOr<std::pair<v1::SideReply, int>> ReadSide() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    pollfd p{side_fd, POLLIN, 0};
    const int ready = poll(&p, 1, kSideReplyTimeoutMs);
    if (ready == 0)
      return absl::DeadlineExceededError("tsd did not answer on the side socket in time");
    auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/false);
    if (!d.ok()) {
      return absl::UnavailableError(notice.empty()
                                        ? "tsd closed the session's side connection (it stopped "
                                          "or dropped this session)"
                                        : notice);
    }
    v1::SideReply reply;
    if (!reply.ParseFromString(d->bytes)) {
      if (d->fd >= 0) close(d->fd);
      return absl::InternalError(
          "tsd sent a side reply this client cannot parse (version mismatch?)");
    }
    if (reply.has_notice()) {
      notice = reply.notice().message();
      if (d->fd >= 0) close(d->fd);
      return absl::UnavailableError(notice);
    }
    if (reply.code() != 0) {
      if (d->fd >= 0) close(d->fd);
      return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
    }
    return std::make_pair(std::move(reply), d->fd);
  }

  // Frees a region of the session's job in the daemon.
  grpc::Status FreeRegion(uint64_t region_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::FreeRequest req;
    *req.mutable_session() = session;
    req.set_region_id(region_id);
    v1::FreeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub->Free(&ctx, req, &resp);
  }

  // Picks up a notice the daemon left on the side socket without waiting.
  void PollNotice() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (side_fd < 0 || !notice.empty()) return;
    bool would_block = false;
    auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/true, &would_block);
    if (!d.ok() || would_block) return;
    if (d->fd >= 0) close(d->fd);
    v1::SideReply reply;
    if (reply.ParseFromString(d->bytes) && reply.has_notice()) notice = reply.notice().message();
  }

  // Turns a failed gRPC call into an error that says what happened to the daemon.
  absl::Status Explain(const grpc::Status& s, const std::string& path)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return wire::FromGrpc(s);
    PollNotice();
    if (!notice.empty()) return absl::UnavailableError(notice);
    return absl::UnavailableError(absl::StrCat("tsd at ", path, " is not answering (",
                                               s.error_message(), "); ", HowToStart(path)));
  }
};

Client::Client(std::string socket_path) : socket_path_(std::move(socket_path)), impl_(new Impl) {}

Client::~Client() {
  if (attached()) (void)Detach();
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& socket_path) {
  const std::string path = wire::ResolveSocketPath(socket_path);
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return absl::UnavailableError(absl::StrCat("no tsd is running at ", path, " (",
                                               std::strerror(errno), "); ", HowToStart(path)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(
        absl::StrCat(path, " exists but is not a socket; ", HowToStart(path)));
  }
  std::unique_ptr<Client> c(new Client(path));
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  c->impl_->channel =
      grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), args);
  c->impl_->stub = v1::Tsd::NewStub(c->impl_->channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusRequest req;
  v1::StatusResponse resp;
  grpc::Status s = c->impl_->stub->Status(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("no tsd is answering at ", path, " (",
                                               s.error_message(), "); ", HowToStart(path)));
  }
  return c;
}

bool Client::attached() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->attached;
}
std::string Client::job() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->job;
}
uint64_t Client::quota_bytes() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->quota_bytes;
}
uint64_t Client::session_id() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->session.session_id();
}

absl::Status Client::Attach(const std::string& job, uint64_t quota_bytes) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->attached) {
    return absl::FailedPreconditionError(absl::StrCat("this client is already attached to job '",
                                                      impl_->job,
                                                      "'; detach first or use another Client"));
  }
  v1::AttachRequest req;
  req.set_job(job);
  req.set_quota_bytes(quota_bytes);
  v1::AttachResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kControlDeadline);
  grpc::Status s = impl_->stub->Attach(&ctx, req, &resp);
  if (!s.ok()) return impl_->Explain(s, socket_path_);

  // Bind the session on the side socket: the daemon learns our uid there.
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& side = resp.side_socket();
  if (side.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return absl::InternalError(absl::StrCat("side socket path '", side, "' is too long"));
  }
  std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to tsd's side socket ", side, ": ", std::strerror(err)));
  }
  v1::SideRequest hello;
  *hello.mutable_hello()->mutable_session() = resp.session();
  std::string bytes;
  hello.SerializeToString(&bytes);
  impl_->side_fd = fd;
  impl_->notice.clear();
  if (absl::Status st = wire::SendDatagram(fd, bytes); !st.ok()) {
    close(fd);
    impl_->side_fd = -1;
    return st;
  }
  auto reply = impl_->ReadSide();
  if (!reply.ok()) {
    close(fd);
    impl_->side_fd = -1;
    return reply.status();
  }
  impl_->attached = true;
  impl_->session = resp.session();
  impl_->job = reply->first.hello().job();
  impl_->quota_bytes = reply->first.hello().quota_bytes();
  return absl::OkStatus();
}

absl::Status Client::Detach() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->attached)
    return absl::FailedPreconditionError("this client is not attached to a job");
  v1::DetachRequest req;
  *req.mutable_session() = impl_->session;
  v1::DetachResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->Detach(&ctx, req, &resp);
  absl::Status result = s.ok() ? absl::OkStatus() : impl_->Explain(s, socket_path_);
  // Whatever the daemon said, this session is over here; closing the side connection also ends it
  // in the daemon if the call did not arrive.
  close(impl_->side_fd);
  impl_->side_fd = -1;
  impl_->attached = false;
  impl_->session.Clear();
  return result;
}

absl::StatusOr<std::shared_ptr<Region>> Client::FetchAndMap(uint64_t region_id) {
  std::shared_ptr<Region> region;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->attached) return absl::FailedPreconditionError("attach to a job first");
    v1::SideRequest req;
    req.mutable_get_fd()->set_region_id(region_id);
    std::string bytes;
    req.SerializeToString(&bytes);
    if (absl::Status s = wire::SendDatagram(impl_->side_fd, bytes); !s.ok()) {
      impl_->PollNotice();
      return impl_->notice.empty() ? s : absl::UnavailableError(impl_->notice);
    }
    auto reply = impl_->ReadSide();
    if (!reply.ok()) return reply.status();
    const auto& info = reply->first.fd().region();
    if (reply->second < 0) return absl::InternalError("tsd's reply carried no descriptor");
    region.reset(
        new Region(RegionDesc{info.region_id(), info.name(), info.size_bytes(), info.locked()},
                   reply->second));
  }
  void* p = mmap(nullptr, region->size(), PROT_READ | PROT_WRITE, MAP_SHARED, region->fd(), 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping region '", region->name(), "' (",
                                                     region->size(),
                                                     " bytes) failed: ", std::strerror(errno)));
  }
  region->data_ = p;
  if (cuda_host::CudaHostAvailable()) {
    if (absl::Status s = cuda_host::Register(p, region->size()); !s.ok()) return s;
    region->cuda_registered_ = true;
  }
  return region;
}

absl::StatusOr<std::shared_ptr<Region>> Client::Alloc(const std::string& name, uint64_t bytes) {
  v1::AllocResponse resp;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->attached) return absl::FailedPreconditionError("attach to a job before allocating");
    v1::AllocRequest req;
    *req.mutable_session() = impl_->session;
    req.set_name(name);
    req.set_size_bytes(bytes);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kControlDeadline);
    grpc::Status s = impl_->stub->Alloc(&ctx, req, &resp);
    if (!s.ok()) return impl_->Explain(s, socket_path_);
  }
  auto region = FetchAndMap(resp.region().region_id());
  if (!region.ok()) {
    // Do not leave a region behind that this caller never got.
    std::lock_guard<std::mutex> lock(impl_->mu);
    (void)impl_->FreeRegion(resp.region().region_id());
  }
  return region;
}

absl::StatusOr<std::vector<RegionDesc>> Client::ListRegions() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->attached) return absl::FailedPreconditionError("attach to a job first");
  v1::ListRegionsRequest req;
  *req.mutable_session() = impl_->session;
  v1::ListRegionsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->ListRegions(&ctx, req, &resp);
  if (!s.ok()) return impl_->Explain(s, socket_path_);
  std::vector<RegionDesc> out;
  for (const auto& r : resp.regions())
    out.push_back({r.region_id(), r.name(), r.size_bytes(), r.locked()});
  return out;
}

absl::StatusOr<std::shared_ptr<Region>> Client::Map(const std::string& name) {
  auto regions = ListRegions();
  if (!regions.ok()) return regions.status();
  for (const auto& r : *regions) {
    if (r.name == name) return FetchAndMap(r.id);
  }
  return absl::NotFoundError(absl::StrCat("job '", job(), "' has no region named '", name,
                                          "' (it has ", regions->size(), " regions)"));
}

absl::Status Client::Free(const std::shared_ptr<Region>& region) {
  if (region == nullptr) return absl::InvalidArgumentError("Free() of a null region");
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->attached) return absl::FailedPreconditionError("attach to a job first");
  grpc::Status s = impl_->FreeRegion(region->id());
  if (!s.ok()) return impl_->Explain(s, socket_path_);
  region->Unmap();
  return absl::OkStatus();
}

absl::StatusOr<PoolStatus> Client::Status() {
  v1::StatusRequest req;
  v1::StatusResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->Status(&ctx, req, &r);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->Explain(s, socket_path_);
  }
  return PoolStatus{r.version(), r.uptime_s(), r.pool_bytes(),          r.used_bytes(), r.locked(),
                    r.jobs(),    r.sessions(), r.max_job_quota_bytes(), r.pid()};
}

absl::StatusOr<std::vector<JobStatus>> Client::Jobs() {
  v1::ListJobsRequest req;
  v1::ListJobsResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->ListJobs(&ctx, req, &r);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->Explain(s, socket_path_);
  }
  std::vector<JobStatus> out;
  for (const auto& j : r.jobs()) {
    out.push_back({j.name(), j.uid(), j.sessions(), j.used_bytes(), j.quota_bytes(), j.regions()});
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::RegisterOptimizer(const OptimizerSpec& spec) {
  v1::RegisterOptimizerRequest req;
  for (const auto& g : spec.groups) {
    auto* p = req.add_groups();
    p->set_lr(g.lr);
    p->set_beta1(g.beta1);
    p->set_beta2(g.beta2);
    p->set_eps(g.eps);
    p->set_weight_decay(g.weight_decay);
    p->set_amsgrad(spec.amsgrad);
    p->set_maximize(spec.maximize);
  }
  for (const auto& b : spec.buckets) {
    auto* p = req.add_buckets();
    p->set_group(b.group);
    p->set_numel(b.numel);
    p->set_grad_dtype(static_cast<v1::DType>(b.grad_dtype));
    p->set_param_dtype(static_cast<v1::DType>(b.param_dtype));
  }
  req.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  req.set_max_grad_norm(spec.max_grad_norm);
  req.set_accumulate(spec.accumulate);
  req.set_seed(spec.seed);
  v1::RegisterOptimizerResponse resp;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (!impl_->attached)
      return absl::FailedPreconditionError("attach to a job before registering an optimizer");
    *req.mutable_session() = impl_->session;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + kControlDeadline);
    grpc::Status s = impl_->stub->RegisterOptimizer(&ctx, req, &resp);
    if (!s.ok()) return impl_->Explain(s, socket_path_);
  }
  std::unique_ptr<Optimizer> opt(new Optimizer);
  opt->client_ = this;
  opt->groups_ = spec.groups.size();
  opt->isa_ = resp.isa();
  opt->threads_ = resp.threads();
  opt->state_bytes_ = resp.state_bytes();
  for (int b = 0; b < resp.buckets_size(); ++b) {
    Optimizer::Bucket bk;
    bk.numel = spec.buckets[static_cast<size_t>(b)].numel;
    bk.grad_dtype = spec.buckets[static_cast<size_t>(b)].grad_dtype;
    bk.param_dtype = spec.buckets[static_cast<size_t>(b)].param_dtype;
    bk.master_offset = resp.buckets(b).master_offset();
    bk.grad_offset = resp.buckets(b).grad_offset();
    bk.param_offset = resp.buckets(b).param_offset();
    opt->buckets_.push_back(bk);
  }
  const std::pair<const char*, std::shared_ptr<Region>*> maps[] = {{"opt/control", &opt->control_},
                                                                   {"opt/master", &opt->master_},
                                                                   {"opt/grads", &opt->grads_},
                                                                   {"opt/params", &opt->params_}};
  for (const auto& [name, slot] : maps) {
    auto r = Map(name);
    if (!r.ok()) return r.status();
    *slot = *r;
  }
  return opt;
}

absl::StatusOr<OptimizerLayout> Client::PlanOptimizer(const OptimizerSpec& spec) {
  v1::RegisterOptimizerRequest req;
  for (const auto& g : spec.groups) {
    auto* p = req.add_groups();
    p->set_lr(g.lr);
    p->set_beta1(g.beta1);
    p->set_beta2(g.beta2);
    p->set_eps(g.eps);
    p->set_weight_decay(g.weight_decay);
    p->set_amsgrad(spec.amsgrad);
    p->set_maximize(spec.maximize);
  }
  for (const auto& b : spec.buckets) {
    auto* p = req.add_buckets();
    p->set_group(b.group);
    p->set_numel(b.numel);
    p->set_grad_dtype(static_cast<v1::DType>(b.grad_dtype));
    p->set_param_dtype(static_cast<v1::DType>(b.param_dtype));
  }
  req.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  req.set_max_grad_norm(spec.max_grad_norm);
  req.set_accumulate(spec.accumulate);
  req.set_seed(spec.seed);
  v1::PlanOptimizerResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->PlanOptimizer(&ctx, req, &r);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->Explain(s, socket_path_);
  }
  if (static_cast<size_t>(r.buckets_size()) != spec.buckets.size()) {
    return absl::InternalError(absl::StrCat("tsd planned ", r.buckets_size(), " buckets for ",
                                            spec.buckets.size(), " (version mismatch?)"));
  }
  OptimizerLayout out;
  for (const auto& b : r.buckets())
    out.buckets.push_back({b.master_offset(), b.grad_offset(), b.param_offset()});
  out.state_bytes = r.state_bytes();
  out.control_bytes = r.control_bytes();
  out.master_bytes = r.master_bytes();
  out.moment_bytes = r.moment_bytes();
  out.grad_bytes = r.grad_bytes();
  out.param_bytes = r.param_bytes();
  out.accum_bytes = r.accum_bytes();
  return out;
}

absl::StatusOr<uint64_t> Client::StateRequest(bool save, int fd) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->attached) return absl::FailedPreconditionError("attach to a job first");
  v1::SideRequest req;
  if (save) {
    req.mutable_save_state();
  } else {
    req.mutable_load_state();
  }
  std::string bytes;
  req.SerializeToString(&bytes);
  if (absl::Status s = wire::SendDatagram(impl_->side_fd, bytes, fd); !s.ok()) return s;
  auto reply = impl_->ReadSide();
  if (!reply.ok()) return reply.status();
  if (reply->second >= 0) close(reply->second);
  return reply->first.state().bytes();
}

bool Client::DaemonAlive(std::string* why) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->side_fd < 0) {
    *why = "this client is not attached to tsd";
    return false;
  }
  pollfd p{impl_->side_fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLIN))) {
    impl_->PollNotice();
    if (!impl_->notice.empty()) {
      *why = impl_->notice;
      return false;
    }
    if (p.revents & (POLLHUP | POLLRDHUP | POLLERR)) {
      *why = absl::StrCat("tsd at ", socket_path_,
                          " closed this session (the daemon exited or was killed); ",
                          "restart it and attach again");
      return false;
    }
  }
  return true;
}

}  // namespace tsd
