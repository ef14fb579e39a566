#include "connector/remotes.h"

#include "engine/metadata.h"
#include "kvbridge/layout_json.h"
#include "net/address.h"

namespace kvbridge::connector {

Remotes::Remotes(Engine& engine, const Layout& local, SideChannelOptions options, std::string identity, uint64_t hash)
    : engine_(engine), local_(local), options_(std::move(options)), identity_(std::move(identity)), hash_(hash) {}

Status Remotes::add(const std::string& instance, std::vector<std::string> addresses) {
  if (addresses.empty()) return Status::invalid_argument("instance '" + instance + "' has no rank");
  // Checked when given, so that a typo fails here and not at the first load.
  for (size_t r = 0; r < addresses.size(); ++r) {
    Result<net::HostPort> hp = net::parse_host_port(
        addresses[r], "side channel address of instance '" + instance + "' rank " + std::to_string(r));
    if (!hp.ok()) return hp.error();
  }
  std::lock_guard<std::mutex> lock(mu_);
  Instance& r = instances_[instance];
  if (r.fetched && r.addresses != addresses) {
    return Status::already_exists("instance '" + instance + "' is already known with other addresses");
  }
  r.addresses = std::move(addresses);
  return Status();
}

std::shared_ptr<const Fetched> Remotes::fetched(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  return it == instances_.end() ? nullptr : it->second.fetched;
}

bool Remotes::known(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  return instances_.count(instance) != 0;
}

std::vector<std::string> Remotes::unfetched() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, i] : instances_) {
    if (!i.fetched) out.push_back(name);
  }
  return out;
}

std::optional<std::pair<std::string, size_t>> Remotes::locate(const std::pair<std::string, uint64_t>& engine) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [name, i] : instances_) {
    if (!i.fetched) continue;
    for (size_t r = 0; r < i.fetched->engines.size(); ++r) {
      if (i.fetched->engines[r] == engine) return std::make_pair(name, r);
    }
  }
  return std::nullopt;
}

bool Remotes::connected(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  if (it == instances_.end() || !it->second.fetched) return false;
  for (const std::optional<PeerId>& p : it->second.peers) {
    if (!p) return false;
  }
  return true;
}

uint64_t Remotes::handshakes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return handshakes_;
}

Result<std::shared_ptr<const Fetched>> Remotes::fetch(const std::string& instance) {
  std::vector<std::string> addresses;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = instances_.find(instance);
    if (it == instances_.end()) return Status::not_found("unknown remote instance '" + instance + "'");
    if (it->second.fetched) return it->second.fetched;
    addresses = it->second.addresses;
  }
  std::lock_guard<std::mutex> fetch(fetch_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (instances_[instance].fetched) return instances_[instance].fetched;
  }
  auto fetched = std::make_shared<Fetched>();
  for (size_t r = 0; r < addresses.size(); ++r) {
    const std::string who = instance + " rank " + std::to_string(r);
    Result<RankInfo> got = fetch_rank_info(addresses[r], identity_, hash_, options_);
    if (!got.ok()) return got.error().with_context(who);
    RankInfo info = std::move(*got);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++handshakes_;
    }
    Result<Layout> parsed = parse_layout(info.layout_json);
    if (!parsed.ok()) return parsed.error().with_context(who + " layout");
    Layout l = std::move(*parsed);
    KVB_RETURN_IF_ERROR(check_compatible(local_, l).with_context(who));
    if (l.rank() != r || uint64_t{l.tp_size} * l.pp_size != addresses.size() ||
        info.tensors.size() != l.tensors.size()) {
      return Status::incompatible(who + " at " + addresses[r] + " describes itself as rank " +
                                  std::to_string(l.rank()) + " of " + std::to_string(l.tp_size * l.pp_size) + " with " +
                                  std::to_string(info.tensors.size()) + " tensor regions");
    }
    Result<engine_internal::EngineMetadata> m = engine_internal::decode_metadata(info.engine_metadata);
    if (!m.ok()) return m.error().with_context(who + " engine metadata");
    fetched->engines.emplace_back(m->name, m->instance);
    fetched->infos.push_back(std::move(info));
    fetched->layouts.push_back(std::move(l));
  }
  std::lock_guard<std::mutex> lock(mu_);
  Instance& r = instances_[instance];
  r.peers.assign(fetched->infos.size(), std::nullopt);
  r.fetched = std::move(fetched);
  return r.fetched;
}

Result<PeerId> Remotes::peer(const std::string& instance, size_t rank) {
  std::string metadata;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = instances_.find(instance);
    if (it == instances_.end() || !it->second.fetched || rank >= it->second.peers.size()) {
      return Status::not_found("no handshake with " + instance + " rank " + std::to_string(rank));
    }
    if (it->second.peers[rank]) return *it->second.peers[rank];
    metadata = it->second.fetched->infos[rank].engine_metadata;
  }
  // Dials and waits for the peer's answer: without the lock.
  KVB_ASSIGN_OR_RETURN(PeerId id, engine_.connect(metadata));
  std::lock_guard<std::mutex> lock(mu_);
  instances_[instance].peers[rank] = id;
  return id;
}

}  // namespace kvbridge::connector
