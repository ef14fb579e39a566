// Peers: decoding their metadata, choosing transports, one connection per
// peer name.
//
// The choice follows tensorpipe's: each side describes what it offers, and
// the first transport in this engine's preference order that the peer also
// offers and that says it can reach the peer (can_reach, then connect) wins.
// When none does, the error lists both sides' transports and each reason, so
// "why is this slow / why does this fail" has an answer in one line.
//
// Memory kinds: a transport moves some pairs of (local, peer) memory kinds
// (Transport::moves: host to host for cma, tcp and ucx; peer device memory
// for cuda_ipc; all for local). A peer gets the first reachable transport
// for each pair that an earlier one does not move, so a same-host peer has
// cuda_ipc for its device memory and cma for its host memory; each transfer
// runs on the first of them that moves all its items (submit.cc).
#include <algorithm>

#include "engine/engine_impl.h"

namespace kvbridge::engine_internal {
namespace {

transport::PeerInfo peer_info(const EngineMetadata& m, size_t transport_index) {
  transport::PeerInfo info;
  info.name = m.name;
  info.pid = m.pid;
  info.hostname = m.hostname;
  info.address = m.transports[transport_index].address;
  for (const MetadataSegment& s : m.segments) {
    info.segments.push_back(transport::PeerSegment{s.id, s.base, s.bytes, s.keys[transport_index], s.memory});
  }
  return info;
}

std::map<RegionId, EngineImpl::Peer::RemoteRegion> index_regions(const EngineMetadata& m) {
  std::map<uint32_t, uint8_t> access;
  for (const MetadataSegment& s : m.segments) access[s.id] = s.access;
  std::map<uint32_t, bool> device;
  for (const MetadataSegment& s : m.segments) device[s.id] = s.memory != "host";
  std::map<RegionId, EngineImpl::Peer::RemoteRegion> out;
  for (const MetadataRegion& r : m.regions) {
    out.emplace(r.id, EngineImpl::Peer::RemoteRegion{r, access[r.segment], device[r.segment]});
  }
  return out;
}

size_t find_transport(const EngineMetadata& m, std::string_view name) {
  for (size_t i = 0; i < m.transports.size(); ++i) {
    if (m.transports[i].name == name) return i;
  }
  return m.transports.size();
}

}  // namespace

Status EngineImpl::open_peer(Peer& peer) {
  const EngineMetadata& m = peer.metadata;
  std::vector<std::string> reasons;
  // The (local device, peer device) pairs a link of this peer moves so far.
  auto covered = [&](bool local_device, bool remote_device) {
    for (const Peer::PeerLink& l : peer.links) {
      if (l.moves(local_device, remote_device)) return true;
    }
    return false;
  };
  for (const auto& t : transports_) {
    const std::string name(t->name());
    bool adds = false;
    for (bool local_device : {false, true}) {
      for (bool remote_device : {false, true}) {
        adds = adds || (t->moves(local_device, remote_device) && !covered(local_device, remote_device));
      }
    }
    if (!adds) continue;
    const size_t k = find_transport(m, name);
    if (k == m.transports.size()) {
      reasons.push_back(name + ": the peer does not offer it");
      continue;
    }
    transport::PeerInfo info = peer_info(m, k);
    if (Status s = t->can_reach(info); !s.ok()) {
      reasons.push_back(name + ": " + s.message());
      continue;
    }
    Result<std::unique_ptr<transport::Link>> link = t->connect(info);
    if (!link.ok()) {
      reasons.push_back(name + ": connect failed: " + link.error().message());
      continue;
    }
    peer.links.push_back(Peer::PeerLink{name, t.get(), std::shared_ptr<transport::Link>(std::move(*link))});
  }
  if (peer.links.empty()) {
    std::string ours, theirs, why;
    for (const auto& t : transports_) ours += (ours.empty() ? "" : ", ") + std::string(t->name());
    for (const auto& t : m.transports) theirs += (theirs.empty() ? "" : ", ") + t.name;
    for (const auto& r : reasons) why += "; " + r;
    return Status::unavailable("no transport reaches peer " + peer_text(m) + ": this engine offers [" + ours +
                               "], the peer offers [" + theirs + "]" + why);
  }
  peer.connection = next_connection_.fetch_add(1);
  const uint64_t connection = peer.connection;
  Result<std::shared_ptr<Channel>> channel =
      control_->connect(m.control_address, m.instance, peer_text(m),
                        [this, connection](const Status& why) { transfers_->fail_peer(connection, why); });
  if (!channel.ok()) {
    peer.links.clear();
    return channel.error();
  }
  peer.channel = std::move(*channel);
  return Status();
}

Result<std::shared_ptr<EngineImpl::Peer>> EngineImpl::find_peer_locked(PeerId id, std::string_view what) const {
  auto it = peers_.find(id);
  if (it == peers_.end())
    return Status::not_found(std::string(what) + ": peer " + std::to_string(id) + " is not connected");
  const std::shared_ptr<Peer>& p = it->second;
  if (Status health = p->channel->health(); !health.ok()) {
    std::string why = std::string(what) + ": peer " + *p->text + ": " + health.message();
    if (!p->replaced_by.empty()) why += "; the name now belongs to " + p->replaced_by;
    return Status(health.code(), why);
  }
  return p;
}

Status EngineImpl::peer_status(PeerId peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  Result<std::shared_ptr<Peer>> p = find_peer_locked(peer, "peer_status");
  return p.ok() ? Status() : p.error();
}

Result<PeerId> EngineImpl::connect(std::string_view bytes) {
  KVB_ASSIGN_OR_RETURN(EngineMetadata m, decode_metadata(bytes));
  // A peer is one engine, (name, instance): never the name alone, or a
  // second engine under a known name would inherit the first one's peer id
  // and its region ids would resolve in the other's memory.
  auto same_engine = [&](const auto& e) {
    return e.second->metadata.name == m.name && e.second->metadata.instance == m.instance;
  };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto same = std::find_if(peers_.begin(), peers_.end(), same_engine);
    if (same != peers_.end()) {
      Peer& p = *same->second;
      const bool same_process = p.metadata.pid == m.pid && p.metadata.hostname == m.hostname &&
                                p.metadata.control_address == m.control_address &&
                                p.metadata.transports == m.transports && p.channel->health().ok();
      if (same_process) {
        // The same engine with new registrations: refresh what items may name.
        for (const Peer::PeerLink& l : p.links) {
          const size_t k = find_transport(m, l.transport);
          KVB_RETURN_IF_ERROR(l.link->refresh(peer_info(m, k)).with_context("connect: refresh peer " + peer_text(m)));
        }
        p.regions = index_regions(m);
        ++p.generation;
        p.metadata = std::move(m);
        p.text = std::make_shared<const std::string>(peer_text(p.metadata));
        return p.id;
      }
    }
  }
  // A new engine, or this one after its connection was lost: a fresh link
  // and channel, opened without the registry lock (dialling and the opening
  // exchange wait on the peer; nothing else in the engine waits for them).
  // Transfers on old ones keep them alive until they end.
  auto p = std::make_shared<Peer>();
  p->metadata = std::move(m);
  p->text = std::make_shared<const std::string>(peer_text(p->metadata));
  p->regions = index_regions(p->metadata);
  KVB_RETURN_IF_ERROR(open_peer(*p).with_context("connect"));
  std::lock_guard<std::mutex> lock(mu_);
  auto same = std::find_if(peers_.begin(), peers_.end(), same_engine);
  if (same != peers_.end()) {
    // The same engine again: its old connection broke, or another connect()
    // raced this one. One peer id per engine either way.
    if (same->second->channel->health().ok()) {
      control_->close(p->channel);
      return same->first;
    }
    p->id = same->first;
    control_->close(same->second->channel);
    same->second = p;
    return p->id;
  }
  p->id = next_peer_++;
  // Peers of this name whose connection is gone were most likely replaced
  // by this one (a restart): say so in what their ids return from now on.
  // Live ones are other engines that share the name; they stay as they are.
  for (auto& [id, old] : peers_) {
    if (old->metadata.name == p->metadata.name && !old->channel->health().ok()) {
      old->replaced_by = *p->text + ", peer " + std::to_string(p->id);
    }
  }
  peers_.emplace(p->id, p);
  return p->id;
}

}  // namespace kvbridge::engine_internal
