// The Redis tier as a node of a Redis Cluster: parse_redirect() of MOVED, ASK,
// CLUSTERDOWN and TRYAGAIN replies, and cluster_slots(), which reads CLUSTER
// SLOTS as it streams in (see redis_tier.h and cluster_tier.h).
#include <charconv>

#include "store/redis_tier.h"
#include "store/redis_tier_io.h"

namespace kvbridge::store_internal {

bool parse_redirect(std::string_view error, Redirect* out) {
  auto word = [&](std::string_view w) { return error.substr(0, w.size()) == w; };
  if (word("CLUSTERDOWN") || word("TRYAGAIN")) {
    out->kind = Redirect::kRetry;
    out->reply = std::string(error.substr(0, 120));
    return true;
  }
  if (!word("MOVED ") && !word("ASK ")) return false;
  out->kind = word("ASK ") ? Redirect::kAsk : Redirect::kMoved;
  error.remove_prefix(out->kind == Redirect::kAsk ? 4 : 6);
  const size_t space = error.find(' ');
  const size_t colon = error.rfind(':');
  if (space == std::string_view::npos || colon == std::string_view::npos || colon < space) return false;
  uint64_t slot = 0, port = 0;
  for (const char c : error.substr(0, space)) {
    if (c < '0' || c > '9' || (slot = slot * 10 + static_cast<uint64_t>(c - '0')) > 16383) return false;
  }
  const std::string_view port_text = error.substr(colon + 1);
  if (port_text.empty()) return false;
  for (const char c : port_text) {
    if (c < '0' || c > '9' || (port = port * 10 + static_cast<uint64_t>(c - '0')) > 65535) return false;
  }
  out->slot = static_cast<uint16_t>(slot);
  out->host = std::string(error.substr(space + 1, colon - space - 1));
  out->port = static_cast<uint16_t>(port);
  return !out->host.empty() && port != 0;
}

namespace {

// CLUSTER SLOTS is read as it streams in, keeping only the ranges: a node
// (lying, or a cluster of many small ranges) cannot make the reply's tree
// take memory; it is bounded in bytes, entries and nesting.
constexpr uint64_t kMaxSlotsReplyBytes = uint64_t{8} << 20;
constexpr int64_t kMaxSlotRanges = 16384;
constexpr int64_t kMaxSlotEntryItems = 64;
constexpr int64_t kMaxNestedItems = 1024;
constexpr int64_t kMaxBulkBytes = 1 << 20;

bool parse_i64(std::string_view text, int64_t* out) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return false;  // past int64 too
  *out = v;
  return true;
}

}  // namespace

// One RESP value of the slots reply, read and dropped (a node id, a
// replica, metadata), at most `depth` levels deep.
bool RedisTier::skip_value_locked(int depth) {
  std::string_view line;
  if (op_bytes_ > kMaxSlotsReplyBytes || !read_line_locked(&line) || line.empty()) return false;
  int64_t n = 0;
  switch (line[0]) {
    case '+':
    case '-':
    case ':':
      return true;
    case '$':
      if (!parse_i64(line.substr(1), &n) || n > kMaxBulkBytes) return false;
      return n < 0 || read_bytes_locked(static_cast<uint64_t>(n) + 2, nullptr);
    case '*':
      if (depth == 0 || !parse_i64(line.substr(1), &n) || n > kMaxNestedItems) return false;
      for (int64_t i = 0; i < n; ++i) {
        if (!skip_value_locked(depth - 1)) return false;
      }
      return true;
  }
  return false;
}

Result<std::vector<SlotRange>> RedisTier::cluster_slots() {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  const std::string where = options_.host + ":" + std::to_string(options_.port);
  if (!connect_locked()) return Status::unavailable("redis " + where + " is unreachable");
  if (!raw_ready_locked())
    return Status::unavailable("redis " + where + ": CLUSTER SLOTS: the connection was not idle");
  if (!send_all_locked("*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n")) {
    fail_locked("CLUSTER SLOTS");
    return Status::unavailable("redis " + where + ": CLUSTER SLOTS: " + counters_.last_error);
  }
  auto bad = [&](const std::string& what) -> Status {
    fail_locked("CLUSTER SLOTS");  // the rest of the reply is not read: the connection goes
    return Status::io_error("redis " + where + ": CLUSTER SLOTS: " + what);
  };
  auto integer = [&](int64_t* v) {
    std::string_view line;
    return op_bytes_ <= kMaxSlotsReplyBytes && read_line_locked(&line) && !line.empty() && line[0] == ':' &&
           parse_i64(line.substr(1), v);
  };
  auto array = [&](int64_t* v) {
    std::string_view line;
    return op_bytes_ <= kMaxSlotsReplyBytes && read_line_locked(&line) && !line.empty() && line[0] == '*' &&
           parse_i64(line.substr(1), v);
  };
  std::string_view line;
  if (!read_line_locked(&line) || line.empty()) return bad("no reply");
  if (line[0] == '-') {
    const std::string error(line.substr(1));
    return Status::incompatible("redis " + where + " is not a cluster node: " + error);
  }
  int64_t entries = 0;
  if (line[0] != '*' || !parse_i64(line.substr(1), &entries)) return bad("not an array");
  if (entries < 0 || entries > kMaxSlotRanges) {
    return bad(std::to_string(entries) + " ranges, more than the " + std::to_string(kMaxSlotRanges) + " slots");
  }
  std::vector<SlotRange> out;
  for (int64_t i = 0; i < entries; ++i) {
    const std::string entry = "entry " + std::to_string(i);
    int64_t items = 0, first = 0, last = 0, parts = 0, port = 0;
    if (!array(&items) || items < 3 || items > kMaxSlotEntryItems || !integer(&first) || !integer(&last) ||
        !array(&parts) || parts < 2 || parts > kMaxSlotEntryItems) {
      return bad(entry + " is malformed" + (op_bytes_ > kMaxSlotsReplyBytes ? " (past 8 MiB)" : ""));
    }
    std::string_view host_line;
    int64_t host_bytes = 0;
    if (!read_line_locked(&host_line) || host_line.empty() || host_line[0] != '$' ||
        !parse_i64(host_line.substr(1), &host_bytes) || host_bytes < 0 || host_bytes > 255) {
      return bad(entry + ": the master's host is not a string of at most 255 bytes");
    }
    SlotRange r;
    if (!read_bytes_locked(static_cast<uint64_t>(host_bytes), &r.host) || !read_bytes_locked(2, nullptr) ||
        !integer(&port)) {
      return bad(entry + " is malformed");
    }
    for (int64_t k = 2; k < parts; ++k) {
      if (!skip_value_locked(2)) return bad(entry + ": the master's node id or metadata is malformed");
    }
    for (int64_t k = 3; k < items; ++k) {
      if (!skip_value_locked(3)) return bad(entry + ": a replica is malformed");
    }
    if (first < 0 || last > 16383 || first > last || port <= 0 || port > 65535) {
      return bad(entry + " is out of range");
    }
    r.first = static_cast<uint16_t>(first);
    r.last = static_cast<uint16_t>(last);
    if (r.host.empty()) r.host = options_.host;  // a node that does not know its address
    r.port = static_cast<uint16_t>(port);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvbridge::store_internal
