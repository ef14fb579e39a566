#include "connector/remotes.h"

#include <algorithm>

#include "common/text.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "net/address.h"

namespace kvbridge::connector {

Remotes::Remotes(Engine& engine, const Layout& local, SideChannelOptions options, std::string identity, uint64_t hash)
    : engine_(engine), local_(local), options_(std::move(options)), identity_(std::move(identity)), hash_(hash) {}

std::string Fetched::incarnation(size_t rank) const { return rank < engines.size() ? hex16(engines[rank].second) : ""; }

namespace {

// Separates an instance's name from the addresses in an alternate key (a
// byte no instance name or address holds).
constexpr char kKeySep = '\x1f';

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

Status check_addresses(const std::string& instance, const std::vector<std::string>& addresses) {
  if (addresses.empty()) return Status::invalid_argument("instance '" + instance + "' has no rank");
  // Checked when given, so that a typo fails here and not at the first load.
  for (size_t r = 0; r < addresses.size(); ++r) {
    Result<net::HostPort> hp = net::parse_host_port(
        addresses[r], "side channel address of instance '" + instance + "' rank " + std::to_string(r));
    if (!hp.ok()) return hp.error();
  }
  return Status();
}

}  // namespace

std::string Remotes::instance_of(const std::string& key) { return key.substr(0, key.find(kKeySep)); }

Result<std::string> Remotes::route(const std::string& instance, const std::vector<std::string>& addresses) {
  std::lock_guard<std::mutex> lock(mu_);
  auto own = instances_.find(instance);
  if (own == instances_.end()) return Status::not_found("unknown remote instance '" + instance + "'");
  if (addresses.empty() || addresses == own->second.addresses) return instance;
  KVB_RETURN_IF_ERROR(check_addresses(instance, addresses));
  std::string key = instance;
  key += kKeySep;
  for (const std::string& a : addresses) key += a + " ";
  auto [it, added] = instances_.try_emplace(key);
  it->second.routed = ++routes_;
  if (added) {
    it->second.addresses = addresses;
    // Kept in bounds: the least recently routed alternate of this instance goes.
    std::vector<std::map<std::string, Instance>::iterator> alternates;
    for (auto a = instances_.lower_bound(instance + kKeySep);
         a != instances_.end() && instance_of(a->first) == instance; ++a) {
      if (a->first.size() > instance.size()) alternates.push_back(a);
    }
    if (alternates.size() > kMaxAlternates) {
      auto oldest = *std::min_element(alternates.begin(), alternates.end(),
                                      [](const auto& a, const auto& b) { return a->second.routed < b->second.routed; });
      if (oldest != it) instances_.erase(oldest);
    }
  }
  return key;
}

std::string Remotes::elsewhere(const std::string& key) const {
  const std::string instance = instance_of(key);
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& [k, i] : instances_) {
    if (k == key || instance_of(k) != instance || !i.fetched || stale_locked(i)) continue;
    std::vector<std::string> incarnations;
    for (size_t r = 0; r < i.fetched->engines.size(); ++r) incarnations.push_back(i.fetched->incarnation(r));
    out += (out.empty() ? "" : "; ") + std::string("incarnation ") + join(incarnations) + " at " + join(i.addresses);
  }
  return out.empty() ? out : q(instance) + " answers as " + out;
}

Result<bool> Remotes::add(const std::string& instance, std::vector<std::string> addresses) {
  KVB_RETURN_IF_ERROR(check_addresses(instance, addresses));
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, added] = instances_.try_emplace(instance);
  Instance& r = it->second;
  if (!added && r.addresses == addresses) return false;
  // New or moved: whatever was fetched from the old addresses is not it.
  r.addresses = std::move(addresses);
  r.fetched.reset();
  r.peers.clear();
  r.generation = ++generations_;
  return true;
}

Status Remotes::remove(const std::string& instance) {
  std::lock_guard<std::mutex> lock(mu_);
  if (instances_.erase(instance) == 0) return Status::not_found("unknown remote instance '" + instance + "'");
  std::erase_if(instances_, [&](const auto& i) { return instance_of(i.first) == instance; });
  return Status();
}

void Remotes::invalidate(const std::string& instance, const Fetched* snapshot) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  if (it == instances_.end() || it->second.fetched.get() != snapshot) return;
  it->second.fetched.reset();
  it->second.peers.clear();
  it->second.generation = ++generations_;
}

bool Remotes::stale_locked(const Instance& i) const {
  for (const std::optional<PeerId>& p : i.peers) {
    if (p && !engine_.peer_status(*p).ok()) return true;
  }
  return false;
}

std::shared_ptr<const Fetched> Remotes::fetched(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  return it == instances_.end() ? nullptr : it->second.fetched;
}

bool Remotes::known(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  return instances_.count(instance_of(instance)) != 0 && instances_.count(instance) != 0;
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

bool Remotes::reads_nothing_from(const std::pair<std::string, uint64_t>& engine) const {
  std::lock_guard<std::mutex> lock(mu_);
  bool found = false;
  for (const auto& [name, i] : instances_) {
    if (!i.fetched) continue;
    for (size_t r = 0; r < i.fetched->engines.size(); ++r) {
      if (i.fetched->engines[r] != engine) continue;
      const std::vector<uint32_t>& s = i.fetched->sources;
      if (!i.fetched->sources_error.ok() || std::find(s.begin(), s.end(), r) != s.end()) return false;
      found = true;
    }
  }
  return found;
}

bool Remotes::connected(const std::string& instance) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  if (it == instances_.end() || !it->second.fetched) return false;
  for (const std::optional<PeerId>& p : it->second.peers) {
    if (!p || !engine_.peer_status(*p).ok()) return false;
  }
  return true;
}

uint64_t Remotes::handshakes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return handshakes_;
}

Result<std::shared_ptr<const Fetched>> Remotes::fetch(const std::string& instance) {
  // The instance replaced while a handshake ran: once more at the new
  // addresses (replacements faster than handshakes fail the caller).
  for (int attempt = 0;; ++attempt) {
    bool replaced = false;
    Result<std::shared_ptr<const Fetched>> f = fetch_once(instance, &replaced);
    if (!replaced || attempt == 2) return f;
  }
}

Result<std::shared_ptr<const Fetched>> Remotes::fetch_once(const std::string& instance, bool* replaced) {
  std::vector<std::string> addresses;
  uint64_t generation = 0;
  auto current = [&]() -> Result<std::shared_ptr<const Fetched>> {
    auto it = instances_.find(instance);
    if (it == instances_.end()) return Status::not_found("unknown remote instance '" + instance_of(instance) + "'");
    Instance& i = it->second;
    if (i.fetched && stale_locked(i)) {
      // A rank is gone (a restart): the next handshake finds what is there now.
      i.fetched.reset();
      i.peers.clear();
      i.generation = ++generations_;
    }
    addresses = i.addresses;
    generation = i.generation;
    return i.fetched;
  };
  std::shared_ptr<std::mutex> round;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> f, current());
    if (f) return f;
    round = instances_.at(instance).round;
  }
  // One handshake round per instance at a time; instances in parallel (a
  // silent one delays only the loads that need it).
  std::lock_guard<std::mutex> fetch(*round);
  {
    std::lock_guard<std::mutex> lock(mu_);
    KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> f, current());
    if (f) return f;
  }
  const std::string name = instance_of(instance);
  auto fetched = std::make_shared<Fetched>();
  for (size_t r = 0; r < addresses.size(); ++r) {
    const std::string who = name + " rank " + std::to_string(r);
    Result<RankInfo> got = fetch_rank_info(addresses[r], identity_, hash_, options_);
    if (!got.ok()) return got.error().with_context(who);
    RankInfo info = std::move(*got);
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++handshakes_;
    }
    if (info.instance_id != name) {
      // Under a secret the rank proved what it says, so an address that
      // names another instance (a stale or forged record) is refused.
      return Status::incompatible(who + " at " + addresses[r] + " is a rank of instance " +
                                  q(printable(info.instance_id)) + ", not " + q(name));
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
    Result<EngineLabel> m = describe_metadata(info.engine_metadata);
    if (!m.ok()) return m.error().with_context(who + " engine metadata");
    fetched->engines.emplace_back(m->name, m->instance);
    fetched->infos.push_back(std::move(info));
    fetched->layouts.push_back(std::move(l));
  }
  if (Result<std::vector<uint32_t>> s = source_ranks(local_, fetched->layouts); s.ok()) {
    fetched->sources = std::move(*s);
  } else {
    fetched->sources_error = s.error();
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  if (it == instances_.end()) return Status::not_found("remote instance '" + name + "' was removed");
  Instance& r = it->second;
  if (r.generation != generation) {
    // Replaced while this handshake ran: what it found belongs to the old
    // addresses. The caller tries again.
    *replaced = true;
    return Status::unavailable("remote instance '" + name + "' changed during the handshake, three times in a row");
  }
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
      return Status::not_found("no handshake with " + instance_of(instance) + " rank " + std::to_string(rank));
    }
    const std::optional<PeerId>& known = it->second.peers[rank];
    // A connection that broke is dialled again: Engine::connect reopens it
    // when the same engine answers, and fails when its process is gone.
    if (known && engine_.peer_status(*known).ok()) return *known;
    metadata = it->second.fetched->infos[rank].engine_metadata;
  }
  // Dials and waits for the peer's answer: without the lock.
  KVB_ASSIGN_OR_RETURN(PeerId id, engine_.connect(metadata));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = instances_.find(instance);
  if (it != instances_.end() && it->second.fetched && it->second.fetched->infos[rank].engine_metadata == metadata) {
    it->second.peers[rank] = id;
  }
  return id;
}

}  // namespace kvbridge::connector
