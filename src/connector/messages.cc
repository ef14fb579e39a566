#include "connector/messages.h"

// Inlined: a stage given as items alone hashes every place it writes, each
// 40 bytes, where a call to the library costs as much as the hash.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <optional>

#include "common/text.h"

namespace kvbridge::connector {
namespace {

constexpr std::string_view kPrefix = "kvb/1 ";
constexpr Message::Kind kKinds[] = {Message::Kind::kHeartbeat, Message::Kind::kDone,      Message::Kind::kReady,
                                    Message::Kind::kWrote,     Message::Kind::kUnwritten, Message::Kind::kCancel,
                                    Message::Kind::kCancelled, Message::Kind::kHeld,      Message::Kind::kReleased,
                                    Message::Kind::kUnread};
constexpr std::string_view kReadyWithEvent = "readyev ";

std::string_view verb(Message::Kind kind) {
  switch (kind) {
    case Message::Kind::kHeartbeat:
      return "hb ";
    case Message::Kind::kDone:
      return "done ";
    case Message::Kind::kReady:
      return "ready ";
    case Message::Kind::kWrote:
      return "wrote ";
    case Message::Kind::kUnwritten:
      return "unwritten ";
    case Message::Kind::kCancel:
      return "cancel ";
    case Message::Kind::kCancelled:
      return "cancelled ";
    case Message::Kind::kHeld:
      return "held ";
    case Message::Kind::kReleased:
      return "released ";
    case Message::Kind::kUnread:
      return "unread ";
  }
  return "";
}

bool staged(Message::Kind kind) { return kind == Message::Kind::kWrote || kind == Message::Kind::kUnwritten; }
bool counted(Message::Kind kind) { return kind == Message::Kind::kHeartbeat || kind == Message::Kind::kDone; }

// A decimal u32 without sign or leading zeros (so each value has one text).
bool parse_u32(std::string_view text, uint32_t* out) {
  if (text.empty() || (text.size() > 1 && text[0] == '0')) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), *out);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

std::string format_message(Message::Kind kind, RequestId request, std::string_view layer) {
  Message m;
  m.kind = kind;
  m.request = std::move(request);
  m.layer = layer;
  return format_message(m);
}

std::string format_message(const Message& m) {
  const bool with_event = m.kind == Message::Kind::kReady && !m.event.empty();
  std::string out = std::string(kPrefix) + std::string(with_event ? kReadyWithEvent : verb(m.kind)) + m.request;
  if (with_event) out += " " + to_hex(m.event);
  if (m.kind == Message::Kind::kReady) out += " " + std::string(m.layer);
  if (counted(m.kind) && m.readers > 0) out += " " + std::to_string(m.readers);
  if (staged(m.kind)) out += " " + std::to_string(m.stage) + " " + std::to_string(m.stages);
  if (m.kind == Message::Kind::kWrote) out += " " + hex16(m.where);
  return out;
}

namespace {

// A sum and an xor of each item's hash: the same for any order of the same
// items, and a count so that a repeated pair does not cancel out. Each item
// is hashed as the reader names it (its local side first).
struct Places {
  bool reads;
  uint64_t sum = 0, x = 0, n = 0;
  void add(const TransferItem& i) {
    const uint64_t v[5] = {reads ? i.local : i.remote, reads ? i.local_offset : i.remote_offset,
                           reads ? i.remote : i.local, reads ? i.remote_offset : i.local_offset, i.bytes};
    add_hash(XXH3_64bits(v, sizeof v));
  }
  void add_hash(uint64_t h) {
    sum += h;
    x ^= h;
    ++n;
  }
  uint64_t digest(uint64_t form) const {
    const uint64_t all[4] = {sum, x, n, form};
    return (XXH3_64bits(all, sizeof all) & ~uint64_t{1}) | form;
  }
};

// An item's offsets and bytes, without its regions (a moved run names them).
uint64_t offsets_hash(const TransferItem& i, bool reads) {
  const uint64_t v[3] = {reads ? i.local_offset : i.remote_offset, reads ? i.remote_offset : i.local_offset, i.bytes};
  return XXH3_64bits(v, sizeof v);
}

}  // namespace

uint64_t write_places(std::span<const TransferItem> items, bool items_are_reads) {
  Places p{items_are_reads};
  for (const TransferItem& i : items) p.add(i);
  return p.digest(0);
}

PlaceSums::PlaceSums(std::span<const TransferItem> items, bool items_are_reads) {
  sum_.resize(items.size() + 1);
  xor_.resize(items.size() + 1);
  for (size_t k = 0; k < items.size(); ++k) {
    const uint64_t h = offsets_hash(items[k], items_are_reads);
    sum_[k + 1] = sum_[k] + h;
    xor_[k + 1] = xor_[k] ^ h;
  }
}

uint64_t write_places(std::span<const TransferItem> items, std::span<const ItemRun> runs, bool items_are_reads,
                      const PlaceSums* sums) {
  if (runs.empty()) return write_places(items, items_are_reads);
  std::optional<PlaceSums> own;
  if (sums == nullptr || sums->size() != items.size()) sums = &own.emplace(items, items_are_reads);
  Places all{items_are_reads};
  for (const ItemRun& r : runs) {
    // The run's items: [first, first + count), within items.
    const uint64_t a = std::min<uint64_t>(r.first, items.size());
    const uint64_t b = a + std::min<uint64_t>(r.count, items.size() - a);
    if (!r.moved) {
      Places literal{items_are_reads};
      for (uint64_t k = a; k < b; ++k) literal.add(items[k]);
      const uint64_t v[4] = {1, literal.sum, literal.x, literal.n};
      all.add_hash(XXH3_64bits(v, sizeof v));
      continue;
    }
    const bool reads = items_are_reads;  // the run named as its items are
    const uint64_t v[8] = {reads ? r.local : r.remote,
                           reads ? r.local_shift : r.remote_shift,
                           reads ? r.remote : r.local,
                           reads ? r.remote_shift : r.local_shift,
                           sums->sum(a, b),
                           sums->xor_of(a, b),
                           b - a,
                           2};
    all.add_hash(XXH3_64bits(v, sizeof v));
  }
  return all.digest(1);
}

std::optional<Message> parse_message(std::string_view m) {
  if (m.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  m.remove_prefix(kPrefix.size());
  Message out;
  bool matched = false;
  const bool with_event = m.substr(0, kReadyWithEvent.size()) == kReadyWithEvent;
  if (with_event) {
    out.kind = Message::Kind::kReady;
    m.remove_prefix(kReadyWithEvent.size());
    matched = true;
  }
  for (Message::Kind k : kKinds) {
    if (matched) break;
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
  std::string_view rest = space == std::string_view::npos ? std::string_view() : m.substr(space);
  if (with_event) {
    if (rest.size() < 2 || rest[0] != ' ') return std::nullopt;
    rest.remove_prefix(1);
    const size_t end = rest.find(' ');
    if (end == std::string_view::npos || end == 0 || end > 2 * kMaxEventHandleBytes) return std::nullopt;
    std::optional<std::string> event = from_hex(rest.substr(0, end));
    if (!event) return std::nullopt;
    out.event = std::move(*event);
    rest.remove_prefix(end);
  }
  if (out.kind == Message::Kind::kReady) {
    if (rest.size() < 2 || rest[0] != ' ') return std::nullopt;
    out.layer = rest.substr(1);
    return out;
  }
  if (staged(out.kind)) {
    if (rest.size() < 2 || rest[0] != ' ') return std::nullopt;
    std::string_view nums = rest.substr(1);
    if (out.kind == Message::Kind::kWrote) {
      // "<stage> <stages> <where>": the last 17 bytes are " " and 16 hex digits.
      if (nums.size() < 17 || nums[nums.size() - 17] != ' ') return std::nullopt;
      std::optional<std::string> where = from_hex(nums.substr(nums.size() - 16));
      if (!where || where->size() != 8) return std::nullopt;
      for (unsigned char c : *where) out.where = (out.where << 8) | c;
      nums.remove_suffix(17);
    }
    const size_t sp = nums.find(' ');
    if (sp == std::string_view::npos || !parse_u32(nums.substr(0, sp), &out.stage) ||
        !parse_u32(nums.substr(sp + 1), &out.stages) || out.stage >= out.stages) {
      return std::nullopt;
    }
    return out;
  }
  if (counted(out.kind) && !rest.empty()) {
    if (rest.size() < 2 || rest[0] != ' ' || !parse_u32(rest.substr(1), &out.readers) || out.readers == 0) {
      return std::nullopt;
    }
    return out;
  }
  return rest.empty() ? std::optional<Message>(out) : std::nullopt;
}

}  // namespace kvbridge::connector
