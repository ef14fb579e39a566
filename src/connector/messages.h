// connector/messages.h: the worker-to-worker messages, carried as engine
// notifications (connector.h): "kvb/1 hb <request id>", "kvb/1 done <request
// id>" (decode -> prefill) and "kvb/1 ready <request id> <layer>" (prefill ->
// decode, streaming). Formatting and parsing live here once.
//
// Pure; thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvbridge/connector.h"

namespace kvbridge::connector {

struct Message {
  enum class Kind : uint8_t { kHeartbeat, kDone, kReady } kind = Kind::kHeartbeat;
  RequestId request;
  std::string_view layer;  // kReady: a view into the parsed text
};

std::string format_message(Message::Kind kind, RequestId request, std::string_view layer = {});
// Nullopt for anything else (another protocol's notification, an id that
// check_request_id() refuses, a ready without a layer, trailing bytes after
// hb or done).
std::optional<Message> parse_message(std::string_view text);

}  // namespace kvbridge::connector
