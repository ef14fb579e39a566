// The side channel's server and client (see side_channel.h and
// docs/formats/handshake.md).
#include "connector/side_channel.h"

#include <time.h>

#include "common/text.h"
#include "kvbridge/layout.h"
#include "net/opening.h"
#include "net/socket.h"
#include "net/wire.h"

namespace kvbridge::connector {
namespace {

uint64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

net::OpeningConfig opening(const SideChannelOptions& o) {
  return net::OpeningConfig{net::Protocol::kSideChannel, kHandshakeVersion, o.secret,
                            net::OpeningLimits{kOpenBodyBytes, kMaxRefuseDetailBytes}};
}

}  // namespace

std::string legacy_version_refusal(uint16_t their_version) {
  // Version 1: "KVBH", u16 version, u8 type (5: Reject), u8 0, u32 length;
  // Reject: u8 code (1: version), u64 hash, u32 + message, u32 + identity.
  const std::string message = "handshake version mismatch: local " + std::to_string(kHandshakeVersion) + ", peer " +
                              std::to_string(their_version);
  net::WireWriter body;
  body.u8(1);
  body.u64(0);
  body.str(message);
  body.str("");
  net::WireWriter w;
  w.u32(0x4842564b);
  w.u16(kHandshakeVersion);
  w.u8(5);
  w.u8(0);
  w.u32(static_cast<uint32_t>(body.out().size()));
  w.raw(body.out());
  return w.take();
}

Result<std::unique_ptr<SideChannelServer>> SideChannelServer::start(const SideChannelOptions& options,
                                                                    std::string identity, uint64_t hash,
                                                                    RankInfo info) {
  if (options.timeout.count() <= 0) return Status::invalid_argument("side channel: timeout must be positive");
  if (identity.size() > kMaxIdentityBytes) {
    return Status::invalid_argument("side channel: identity is " + std::to_string(identity.size()) +
                                    " bytes, more than " + std::to_string(kMaxIdentityBytes));
  }
  KVB_RETURN_IF_ERROR(check_rank_info(info));
  KVB_ASSIGN_OR_RETURN(net::HostPort bind, net::parse_host(options.host, "side channel host", options.port));
  std::unique_ptr<SideChannelServer> s(new SideChannelServer());
  s->identity_ = std::move(identity);
  s->hash_ = hash;
  s->advertise_host_ = options.advertise_host;
  s->info_ = std::move(info);
  net::ListenerOptions l;
  l.name = "side channel";
  l.thread_name = "kvb-side-listen";
  l.bind = bind;
  l.opening = opening(options);
  l.limit = max_payload_bytes;
  l.max_pending = options.max_pending;
  l.open_timeout = options.timeout;
  l.on_open = [raw = s.get()](const net::OpenRequest& r) { return raw->answer(r); };
  l.legacy_reply = [](net::Protocol, uint16_t version) { return legacy_version_refusal(version); };
  KVB_ASSIGN_OR_RETURN(s->listener_, net::Listener::start(std::move(l)));
  return s;
}

SideChannelServer::~SideChannelServer() { listener_.reset(); }

net::Answer SideChannelServer::answer(const net::OpenRequest& request) {
  Result<uint64_t> hash = decode_open_body(request.body);
  if (!hash.ok())
    return net::Answer::refuse(net::RefuseCode::kMalformed, "malformed handshake: " + hash.error().message());
  if (*hash != hash_) {
    // The client learns our identity only now, after the opening exchange,
    // so that it can name the field.
    return net::Answer::refuse(net::RefuseCode::kMismatch,
                               "compatibility hash mismatch (local " + hex16(hash_) + ", peer " + hex16(*hash) + ")",
                               encode_mismatch_detail(hash_, identity_));
  }
  Result<std::string> payload = Status::internal("unset");
  {
    std::lock_guard<std::mutex> lock(mu_);
    info_.clock_ns = realtime_ns();
    payload = encode_metadata({hash_, info_});
  }
  if (!payload.ok()) {
    return net::Answer::refuse(net::RefuseCode::kUnavailable,
                               "cannot serve the rank info: " + payload.error().message());
  }
  return net::Answer::reply(kMetadataFrame, std::move(*payload));
}

std::string SideChannelServer::address() const {
  net::HostPort at = listener_->address();
  if (!advertise_host_.empty()) at.host = advertise_host_;
  return net::format_host_port(at);
}

void SideChannelServer::set_info(RankInfo info) {
  std::lock_guard<std::mutex> lock(mu_);
  info_ = std::move(info);
}

uint64_t SideChannelServer::served() const { return listener_->stats().replied; }

uint64_t SideChannelServer::rejected() const {
  const net::ListenerStats s = listener_->stats();
  return s.refused + s.abandoned;
}

std::string SideChannelServer::last_rejection() const { return listener_->stats().last_failure; }

Result<RankInfo> fetch_rank_info(std::string_view address, std::string_view local_identity, uint64_t local_hash,
                                 const SideChannelOptions& options) {
  const std::string who = "side channel " + printable(address);
  KVB_ASSIGN_OR_RETURN(net::HostPort to, net::parse_host_port(address, "side channel address"));
  const net::IoLimits limits{net::Clock::now() + options.timeout, nullptr, nullptr};
  net::Refusal refusal;
  Result<net::Dialed> dialed =
      net::dial_and_open(to, opening(options), encode_open_body(local_hash), max_payload_bytes, limits, who, &refusal);
  Result<net::Opened> opened =
      dialed.ok() ? Result<net::Opened>(std::move(dialed->opened)) : Result<net::Opened>(dialed.error());
  if (!opened.ok()) {
    const Status& e = opened.error();
    if (refusal.code == net::RefuseCode::kMismatch && !refusal.detail.empty()) {
      Result<std::pair<uint64_t, std::string>> detail = decode_mismatch_detail(refusal.detail);
      if (detail.ok()) {
        Status why = compare_identity_text(local_identity, detail->second);
        return Status::incompatible(who + ": compatibility hash mismatch (local " + hex16(local_hash) + ", peer " +
                                    hex16(detail->first) + ")" + (why.ok() ? "" : ": " + why.message()));
      }
    }
    if (e.code() == Code::kInvalidArgument) {
      std::string m = e.message();
      const std::string prefix = who + ": ";
      if (m.rfind(prefix, 0) == 0) m = m.substr(prefix.size());
      if (m.rfind("malformed: ", 0) == 0) m = m.substr(11);
      return Status::invalid_argument(prefix + "malformed handshake: " + m);
    }
    return e;
  }
  if (opened->header.type != kMetadataFrame) {
    return Status::invalid_argument(who + ": malformed handshake: expected a Metadata frame, got frame type " +
                                    std::to_string(opened->header.type));
  }
  Result<Metadata> m = decode_metadata(opened->payload);
  if (!m.ok()) return Status::invalid_argument(who + ": malformed handshake: " + m.error().message());
  if (m->hash != local_hash) {
    return Status::incompatible(who + ": the Metadata frame carries hash " + hex16(m->hash) + ", not ours " +
                                hex16(local_hash));
  }
  return std::move(m->info);
}

}  // namespace kvbridge::connector
