#include "connector/messages.h"

#include <charconv>

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
  std::string out = std::string(kPrefix) + std::string(verb(kind)) + std::to_string(request);
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
  const auto [end, ec] = std::from_chars(m.data(), m.data() + m.size(), out.request);
  if (ec != std::errc()) return std::nullopt;
  const std::string_view rest(end, static_cast<size_t>(m.data() + m.size() - end));
  if (out.kind != Message::Kind::kReady) return rest.empty() ? std::optional<Message>(out) : std::nullopt;
  if (rest.size() < 2 || rest[0] != ' ') return std::nullopt;
  out.layer = rest.substr(1);
  return out;
}

}  // namespace kvbridge::connector
