// Peers: decoding their metadata, choosing a transport, one connection per
// peer name.
//
// The choice follows tensorpipe's: each side describes what it offers, and
// the first transport in this engine's preference order that the peer also
// offers and that says it can reach the peer (can_reach, then connect) wins.
// When none does, the error lists both sides' transports and each reason, so
// "why is this slow / why does this fail" has an answer in one line.
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
    info.segments.push_back(transport::PeerSegment{s.id, s.base, s.bytes, s.keys[transport_index]});
  }
  return info;
}

std::map<RegionId, MetadataRegion> index_regions(const EngineMetadata& m) {
  std::map<RegionId, MetadataRegion> out;
  for (const MetadataRegion& r : m.regions) out.emplace(r.id, r);
  return out;
}

size_t find_transport(const EngineMetadata& m, std::string_view name) {
  for (size_t i = 0; i < m.transports.size(); ++i) {
    if (m.transports[i].name == name) return i;
  }
  return m.transports.size();
}

}  // namespace

Status EngineImpl::open_peer_locked(Peer& peer) {
  const EngineMetadata& m = peer.metadata;
  std::vector<std::string> reasons;
  for (const auto& t : transports_) {
    const std::string name(t->name());
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
    peer.transport = name;
    peer.link = std::shared_ptr<transport::Link>(std::move(*link));
    break;
  }
  if (!peer.link) {
    std::string ours, theirs, why;
    for (const auto& t : transports_) ours += (ours.empty() ? "" : ", ") + std::string(t->name());
    for (const auto& t : m.transports) theirs += (theirs.empty() ? "" : ", ") + t.name;
    for (const auto& r : reasons) why += "; " + r;
    return Status::unavailable("no transport reaches peer '" + m.name + "': this engine offers [" + ours +
                               "], the peer offers [" + theirs + "]" + why);
  }
  peer.connection = next_connection_++;
  const uint64_t connection = peer.connection;
  Result<std::shared_ptr<Channel>> channel = control_->connect(
      m.control_address, m.name,
      [this, connection](const Status& why) { transfers_->fail_peer(connection, why); },
      Clock::now() + options_.default_timeout);
  if (!channel.ok()) {
    peer.link.reset();
    return channel.error();
  }
  peer.channel = std::move(*channel);
  return Status();
}

Result<PeerId> EngineImpl::connect(std::string_view bytes) {
  KVB_ASSIGN_OR_RETURN(EngineMetadata m, decode_metadata(bytes));
  std::lock_guard<std::mutex> lock(mu_);
  auto same_name = std::find_if(peers_.begin(), peers_.end(), [&](const auto& e) { return e.second->metadata.name == m.name; });
  if (same_name != peers_.end()) {
    Peer& p = *same_name->second;
    const bool same_process = p.metadata.pid == m.pid && p.metadata.hostname == m.hostname &&
                              p.metadata.control_address == m.control_address &&
                              p.metadata.transports == m.transports && p.channel->health().ok();
    if (same_process) {
      // The same engine with new registrations: refresh what items may name.
      const size_t k = find_transport(m, p.transport);
      KVB_RETURN_IF_ERROR(p.link->refresh(peer_info(m, k)).with_context("connect: refresh peer '" + m.name + "'"));
      p.regions = index_regions(m);
      p.metadata = std::move(m);
      return p.id;
    }
  }
  // A new peer, or one that restarted or lost its connection: a fresh link
  // and channel. Transfers on the old ones keep them alive until they end.
  auto p = std::make_shared<Peer>();
  p->metadata = std::move(m);
  p->regions = index_regions(p->metadata);
  KVB_RETURN_IF_ERROR(open_peer_locked(*p).with_context("connect"));
  if (same_name != peers_.end()) {
    p->id = same_name->first;
    control_->close(same_name->second->channel);
    same_name->second = p;
  } else {
    p->id = next_peer_++;
    peers_.emplace(p->id, p);
  }
  return p->id;
}

}  // namespace kvbridge::engine_internal
