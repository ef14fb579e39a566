#include "connector/messages.h"

namespace kvbridge::connector {
namespace {

constexpr std::string_view kPrefix = "kvb/1 ";

std::string_view verb(Message::Kind kind) {
  switch (kind) {
    case Message::Kind::kHeartbeat:
      return "hb ";
    case Message::Kind::kDone:
      return "done ";
    case Message::Kind::kReady:
      return "ready ";
  }
  return "";
}

}  // namespace

std::string format_message(Message::Kind kind, RequestId request, std::string_view layer) {
  std::string out = std::string(kPrefix) + std::string(verb(kind)) + request;
  if (kind == Message::Kind::kReady) out += " " + std::string(layer);
  return out;
}

std::optional<Message> parse_message(std::string_view m) {
  if (m.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  m.remove_prefix(kPrefix.size());
  Message out;
  bool matched = false;
  for (Message::Kind k : {Message::Kind::kHeartbeat, Message::Kind::kDone, Message::Kind::kReady}) {
    if (m.substr(0, verb(k).size()) == verb(k)) {
      out.kind = k;
      m.remove_prefix(verb(k).size());
      matched = true;
      break;
    }
  }
  if (!matched || m.empty()) return std::nullopt;
  const size_t space = m.find(' ');
  const std::string_view id = m.substr(0, space);
  if (!check_request_id(id).ok()) return std::nullopt;
  out.request = std::string(id);
  const std::string_view rest = space == std::string_view::npos ? std::string_view() : m.substr(space);
  if (out.kind != Message::Kind::kReady) return rest.empty() ? std::optional<Message>(out) : std::nullopt;
  if (rest.size() < 2 || rest[0] != ' ') return std::nullopt;
  out.layer = rest.substr(1);
  return out;
}

}  // namespace kvbridge::connector
