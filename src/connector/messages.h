// connector/messages.h: the worker-to-worker messages, carried as engine
// notifications (connector.h). Decode -> prefill: "kvb/1 hb <request id>",
// "kvb/1 done <request id>", and in push mode "kvb/1 cancel <request id>".
// Prefill -> decode: "kvb/1 ready <request id> <layer>" (pull streaming),
// and in push mode "kvb/1 wrote <request id> <stage> <stages>" (the stage's
// bytes from this rank landed: sent after them), "kvb/1 unwritten <request
// id> <stage> <stages>" (they will not) and "kvb/1 cancelled <request id>"
// (nothing more of the request lands). Formatting and parsing live here once.
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
  enum class Kind : uint8_t {
    kHeartbeat,
    kDone,
    kReady,
    kWrote,
    kUnwritten,
    kCancel,
    kCancelled
  } kind = Kind::kHeartbeat;
  RequestId request;
  std::string_view layer;          // kReady: a view into the parsed text
  uint32_t stage = 0, stages = 0;  // kWrote, kUnwritten: stage < stages
};

std::string format_message(Message::Kind kind, RequestId request, std::string_view layer = {});
std::string format_message(const Message& message);
// Nullopt for anything else (another protocol's notification, an id that
// check_request_id() refuses, a ready without a layer, a stage that is not
// decimal below its count, trailing bytes).
std::optional<Message> parse_message(std::string_view text);

}  // namespace kvbridge::connector
