// The engine: construction, transports, registrations, metadata,
// notifications and teardown. Peers are in peers.cc, submit in submit.cc.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>

#include "common/checked.h"
#include "common/host.h"
#include "common/random.h"
#include "device/device.h"
#include "engine/engine_impl.h"
#include "net/address.h"

namespace kvbridge {

std::string_view transfer_state_name(TransferState state) {
  switch (state) {
    case TransferState::kInProgress:
      return "in_progress";
    case TransferState::kDone:
      return "done";
    case TransferState::kFailed:
      return "failed";
    case TransferState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options) {
  // Peers dial what the metadata says; a wildcard bind says nothing dialable.
  KVB_RETURN_IF_ERROR(net::check_advertised(options.host, options.advertise_host, "engine host", "advertise_host"));
  KVB_RETURN_IF_ERROR(device::parse_copy_method(options.device_copy).status().with_context("device_copy"));
  std::vector<TransportReport> reports;
  KVB_ASSIGN_OR_RETURN(auto transports, engine_internal::make_transports(options, &reports));
  return engine_internal::create_engine(options, std::move(transports), std::move(reports));
}

}  // namespace kvbridge

namespace kvbridge::engine_internal {
namespace {

const char* const kKnownTransports[] = {"local", "cuda_ipc", "cma", "tcp", "ucx"};

Result<std::unique_ptr<transport::Transport>> make_one(const std::string& name, const EngineOptions& options) {
  const transport::DeviceCopyConfig device_copy{options.device_copy, options.device_copy_blocks,
                                                options.device_copy_kernel_below, options.device_copy_kernel_min};
  if (name == "local") return transport::make_local_transport(device_copy);
  if (name == "cma") return transport::make_cma_transport();
  if (name == "tcp") {
    return transport::make_tcp_transport(options.host, options.tcp_streams, options.secret, options.advertise_host,
                                         {options.staging_bytes, options.staging_chunk_bytes}, device_copy);
  }
  if (name == "ucx") {
    return transport::make_ucx_transport(options.host, {options.staging_bytes, options.staging_chunk_bytes},
                                         device_copy);
  }
  if (name == "cuda_ipc") return transport::make_cuda_ipc_transport(device_copy);
  return Status::invalid_argument("unknown transport '" + name + "' (known: local, cuda_ipc, cma, tcp, ucx)");
}

}  // namespace

Result<std::vector<std::unique_ptr<transport::Transport>>> make_transports(const EngineOptions& options,
                                                                           std::vector<TransportReport>* reports) {
  const bool explicit_list = !options.transports.empty();
  std::vector<std::string> names = options.transports;
  if (!explicit_list) names.assign(std::begin(kKnownTransports), std::end(kKnownTransports));
  std::vector<std::unique_ptr<transport::Transport>> out;
  for (const std::string& name : names) {
    if (std::count(names.begin(), names.end(), name) > 1) {
      return Status::invalid_argument("transport '" + name + "' is listed more than once");
    }
    // UCX's listener cannot check the secret (EngineOptions::ucx_trusted_network).
    if (name == "ucx" && !options.secret.empty() && !options.ucx_trusted_network) {
      const std::string why =
          "UCX's own listener cannot check the shared secret, and UCX serves remote memory access to any peer "
          "that completes its wire-up";
      if (explicit_list) {
        return Status::invalid_argument("transport 'ucx' with a shared secret: " + why +
                                        "; set ucx_trusted_network when every host that can reach its interface is "
                                        "trusted, or use tcp, which checks the secret");
      }
      reports->push_back(TransportReport{name, false, "left out with a shared secret: " + why});
      continue;
    }
    Result<std::unique_ptr<transport::Transport>> t = make_one(name, options);
    if (!t.ok() && t.error().code() == Code::kInvalidArgument) return t.error();
    if (!t.ok() && explicit_list) {
      return Status::unavailable("transport '" + name + "' cannot run here: " + t.error().message());
    }
    reports->push_back(TransportReport{name, t.ok(), t.ok() ? "" : t.error().message()});
    if (t.ok()) out.push_back(std::move(*t));
  }
  return out;
}

std::string default_engine_name() {
  std::string host = this_hostname().substr(0, 63);
  if (host.empty()) host = "host";
  char suffix[8];
  std::snprintf(suffix, sizeof(suffix), "%04x", static_cast<unsigned>(random_nonzero_u64() & 0xffff));
  return "kvbridge-" + host + "-" + std::to_string(::getpid()) + "-" + suffix;
}

Result<std::unique_ptr<Engine>> create_engine(const EngineOptions& given,
                                              std::vector<std::unique_ptr<transport::Transport>> transports,
                                              std::vector<TransportReport> reports, EngineHooks hooks) {
  EngineOptions options = given;
  if (options.name.empty()) options.name = default_engine_name();
  if (options.name.size() > kMaxNameBytes) {
    return Status::invalid_argument("engine name must be 1 to " + std::to_string(kMaxNameBytes) + " bytes");
  }
  if (reports.empty()) {
    for (const auto& t : transports) reports.push_back(TransportReport{std::string(t->name()), true, ""});
  }
  auto engine = std::make_unique<EngineImpl>(options, std::move(transports), std::move(reports), std::move(hooks));
  KVB_RETURN_IF_ERROR(engine->init());
  return std::unique_ptr<Engine>(std::move(engine));
}

EngineImpl::EngineImpl(const EngineOptions& options, std::vector<std::unique_ptr<transport::Transport>> transports,
                       std::vector<TransportReport> reports, EngineHooks hooks)
    : options_(options), reports_(std::move(reports)), hooks_(std::move(hooks)), transports_(std::move(transports)) {}

Status EngineImpl::init() {
  hostname_ = this_hostname();
  if (hostname_.empty()) {
    return Status::io_error("gethostname failed: the engine needs a host identity for its metadata");
  }
  pid_ = static_cast<uint64_t>(::getpid());
  instance_ = random_nonzero_u64();
  std::vector<transport::Transport*> raw;
  for (const auto& t : transports_) {
    t->set_local_identity(options_.name, instance_);
    raw.push_back(t.get());
  }
  registry_ = std::make_unique<Registry>(std::move(raw));
  bool moves_device = false;
  for (const auto& t : transports_) moves_device = moves_device || t->serves("cuda:0");
  registry_->set_pin_host(options_.pin_host_memory && moves_device && device::current().count().ok());
  ControlOptions control;
  control.host = options_.host;
  control.advertise_host = options_.advertise_host;
  control.secret = options_.secret;
  control.self = ControlIdentity{options_.name, instance_, pid_};
  control.open_timeout = options_.connect_timeout;
  KVB_ASSIGN_OR_RETURN(
      control_, Control::create(std::move(control), [this](Notification n) { return on_notification(std::move(n)); }));
  Transfers::Callbacks callbacks;
  callbacks.drop_notification = hooks_.drop_notification;
  transfers_ = std::make_unique<Transfers>(options_.threads, &metrics_, std::move(callbacks));
  return Status();
}

EngineImpl::~EngineImpl() {
  // Closing channels first wakes workers waiting for acknowledgements, so
  // the transfers can end promptly.
  std::vector<std::shared_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, p] : peers_) peers.push_back(p);
  }
  if (control_) {
    for (auto& p : peers) control_->close(p->channel);
  }
  if (transfers_) transfers_->shutdown();
  control_.reset();
  peers.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    peers_.clear();
  }
  transfers_.reset();
  registry_.reset();
  transports_.clear();
}

Result<RegionId> EngineImpl::register_memory(void* base, uint64_t bytes, std::string_view memory, RemoteAccess access) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t before = registry_->num_regions();
  KVB_ASSIGN_OR_RETURN(RegionId id, registry_->add(base, bytes, memory, static_cast<uint8_t>(access)));
  if (registry_->num_regions() > before) {
    // The metadata bound is a promise to peers; keep it at registration.
    Result<std::string> encoded = encode_metadata(describe_locked());
    if (!encoded.ok()) {
      (void)registry_->remove(id);
      return encoded.error().with_context("register_memory");
    }
  }
  return id;
}

Status EngineImpl::deregister_memory(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  return registry_->remove(id);
}

// Requires mu_: the grant of `ranges` and their `repeats` to the engine
// labelled `label`.
Result<GrantId> EngineImpl::grant_locked(const std::string& label, std::span<const WriteGrant> ranges,
                                         std::span<const GrantRepeat> repeats, bool read) {
  const char* op = read ? "grant_reads" : "grant_writes";
  auto places = std::make_shared<transport::GrantPlaces>();
  places->spans.reserve(ranges.size());
  // Ranges come grouped by region (a request's blocks, tensor by tensor):
  // each region is looked up once per group, and a message is made only
  // for a range that is wrong.
  const Region* region = nullptr;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const WriteGrant& g = ranges[i];
    if (region == nullptr || region->id != g.region) region = registry_->find(g.region);
    uint64_t end = 0;
    if (g.bytes == 0 || region == nullptr || !checked_add(g.offset, g.bytes, &end) || end > region->bytes) {
      const std::string what = std::string(op) + ": range " + std::to_string(i);
      if (g.bytes == 0) return Status::invalid_argument(what + " is empty");
      return registry_->resolve(g.region, g.offset, g.bytes, what).status();
    }
    places->spans.push_back({region->segment, reinterpret_cast<uint64_t>(region->base + g.offset), g.bytes});
  }
  // A repeat moves its ranges as one: checked by the lowest offset and the
  // highest end of the ranges it names, found once per (first, count) (a
  // request's blocks, repeated in every tensor).
  struct Extent {
    RegionId region;
    uint64_t low, high;
  };
  std::map<std::pair<uint64_t, uint64_t>, Extent> extents;
  places->repeats.reserve(repeats.size());
  for (size_t i = 0; i < repeats.size(); ++i) {
    const GrantRepeat& r = repeats[i];
    const std::string what = std::string(op) + ": repeat " + std::to_string(i);
    if (r.count == 0) return Status::invalid_argument(what + " names no ranges");
    if (r.first >= ranges.size() || r.count > ranges.size() - r.first) {
      return Status::invalid_argument(what + " names ranges [" + std::to_string(r.first) + ", +" +
                                      std::to_string(r.count) + ") of " + std::to_string(ranges.size()));
    }
    auto e = extents.find({r.first, r.count});
    if (e == extents.end()) {
      Extent x{ranges[r.first].region, ranges[r.first].offset, 0};
      for (uint64_t k = r.first; k < r.first + r.count; ++k) {
        if (ranges[k].region != x.region) {
          return Status::invalid_argument(what + " names ranges of regions " + std::to_string(x.region) + " and " +
                                          std::to_string(ranges[k].region) + " (a repeat moves ranges of one region)");
        }
        x.low = std::min(x.low, ranges[k].offset);
        x.high = std::max(x.high, ranges[k].offset + ranges[k].bytes);
      }
      e = extents.emplace(std::make_pair(r.first, r.count), x).first;
    }
    const Extent& x = e->second;
    const Region* to = registry_->find(r.region);
    if (to == nullptr) return registry_->resolve(r.region, 0, 1, what).status();
    const uint64_t low = x.low + r.shift;  // modulo 2^64, as the shift is
    if (low > to->bytes || x.high - x.low > to->bytes - low) {
      return Status::out_of_range(what + ": its ranges moved by " + std::to_string(static_cast<int64_t>(r.shift)) +
                                  " are [" + std::to_string(low) + ", " + std::to_string(low + (x.high - x.low)) +
                                  ") of region " + std::to_string(r.region) + ", which has " +
                                  std::to_string(to->bytes) + " bytes");
    }
    const Region* from = registry_->find(x.region);
    places->repeats.push_back(
        {r.first, r.count, to->segment,
         reinterpret_cast<uint64_t>(to->base) + r.shift - reinterpret_cast<uint64_t>(from->base)});
  }
  const GrantId id = next_grant_++;
  std::shared_ptr<const transport::GrantPlaces> shared = std::move(places);
  for (const auto& t : transports_) t->grant(id, label, shared, read);
  return id;
}

Result<GrantId> EngineImpl::grant_writes(PeerId peer, std::span<const WriteGrant> ranges,
                                         std::span<const GrantRepeat> repeats) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = peers_.find(peer);
  if (p == peers_.end()) return Status::not_found("grant_writes: unknown peer " + std::to_string(peer));
  return grant_locked(transport::engine_label(p->second->metadata.name, p->second->metadata.instance), ranges, repeats,
                      false);
}

void EngineImpl::revoke_writes(GrantId grant) {
  for (const auto& t : transports_) t->revoke(grant);
}

Result<GrantId> EngineImpl::grant_reads(std::string_view peer_name, uint64_t peer_instance,
                                        std::span<const WriteGrant> ranges, std::span<const GrantRepeat> repeats) {
  if (peer_name.empty()) return Status::invalid_argument("grant_reads: the reader's name is empty");
  std::lock_guard<std::mutex> lock(mu_);
  return grant_locked(transport::engine_label(peer_name, peer_instance), ranges, repeats, true);
}

Result<GrantId> EngineImpl::share_reads(GrantId like, std::string_view peer_name, uint64_t peer_instance) {
  if (peer_name.empty()) return Status::invalid_argument("share_reads: the reader's name is empty");
  std::lock_guard<std::mutex> lock(mu_);
  const GrantId id = next_grant_++;
  const std::string label = transport::engine_label(peer_name, peer_instance);
  for (const auto& t : transports_) t->share(id, label, like);
  return id;
}

void EngineImpl::revoke_reads(GrantId grant) { revoke_writes(grant); }

EngineMetadata EngineImpl::describe_locked() const {
  EngineMetadata m;
  m.name = options_.name;
  m.instance = instance_;
  m.pid = pid_;
  m.hostname = hostname_;
  m.control_address = control_->address();
  for (const auto& t : transports_) m.transports.push_back(MetadataTransport{std::string(t->name()), t->address()});
  registry_->describe(&m);
  return m;
}

std::string EngineImpl::metadata() const {
  std::lock_guard<std::mutex> lock(mu_);
  Result<std::string> encoded = encode_metadata(describe_locked());
  // register_memory() keeps the encoding within bounds, and everything else
  // in it is checked at create(); an error here is a bug.
  assert(encoded.ok());
  return encoded.ok() ? *encoded : std::string();
}

std::string EngineImpl::on_notification(Notification n) {
  std::string answer;
  {
    // Answered before it is queued: whoever takes it sees what was answered.
    std::lock_guard<std::mutex> lock(answerer_mu_);
    if (answerer_) answer = answerer_(n);
  }
  {
    std::lock_guard<std::mutex> lock(notes_mu_);
    notes_.push_back(std::move(n));
    metrics_.notification_received();
  }
  std::lock_guard<std::mutex> lock(listener_mu_);
  if (listener_) listener_();
  return answer;
}

void EngineImpl::set_notification_answerer(std::function<std::string(const Notification&)> answer) {
  std::lock_guard<std::mutex> lock(answerer_mu_);
  answerer_ = std::move(answer);
}

void EngineImpl::set_notification_listener(std::function<void()> wake) {
  std::lock_guard<std::mutex> lock(listener_mu_);
  listener_ = std::move(wake);
}

std::vector<Notification> EngineImpl::take_notifications() {
  std::lock_guard<std::mutex> lock(notes_mu_);
  std::vector<Notification> out;
  out.swap(notes_);
  return out;
}

Status EngineImpl::notify(PeerId peer, std::string message) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(p, find_peer_locked(peer, "notify"));
  }
  if (message.size() > kMaxControlPayload) {
    return Status::resource_exhausted("notify: message is " + std::to_string(message.size()) + " bytes, more than " +
                                      std::to_string(kMaxControlPayload));
  }
  const Clock::time_point deadline = Clock::now() + options_.default_timeout;
  KVB_RETURN_IF_ERROR(transfers_->wait_peer(p->connection, deadline).with_context("notify"));
  const bool drop = hooks_.drop_notification && hooks_.drop_notification(message);
  KVB_RETURN_IF_ERROR(p->channel->notify_and_wait(std::move(message), deadline, drop).with_context("notify"));
  metrics_.notification_sent();
  return Status();
}

void EngineImpl::notify(PeerId peer, std::string message, std::chrono::milliseconds timeout,
                        std::function<void(Status)> done) {
  ask(peer, std::move(message), timeout, [done = std::move(done)](Status s, std::string) { done(std::move(s)); });
}

void EngineImpl::ask(PeerId peer, std::string message, std::chrono::milliseconds timeout,
                     std::function<void(Status, std::string)> answered) {
  std::shared_ptr<Peer> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Result<std::shared_ptr<Peer>> found = find_peer_locked(peer, "notify");
    if (!found.ok()) return answered(found.error(), {});
    p = std::move(*found);
  }
  if (timeout.count() <= 0) timeout = options_.default_timeout;
  const Clock::time_point deadline = Clock::now() + timeout;
  const bool drop = hooks_.drop_notification && hooks_.drop_notification(message);
  if (hooks_.duplicate_notification && hooks_.duplicate_notification(message)) {
    p->channel->notify(message, deadline, [](Status, std::string) {});
  }
  p->channel->notify(
      std::move(message), deadline,
      [this, answered = std::move(answered)](Status s, std::string answer) {
        if (s.ok()) metrics_.notification_sent();
        answered(s.ok() ? s : s.with_context("notify"), std::move(answer));
      },
      drop);
}

}  // namespace kvbridge::engine_internal
