// etcd v3 through its JSON gateway (see etcd_client.h).
//
// Why the gateway and not gRPC: etcd serves the same API as JSON over HTTP
// at /v3/... (grpc-gateway), so one small, ubiquitous dependency (libcurl)
// replaces protoc-generated code and the gRPC runtime, and what kvbridge
// sends is exactly what an operator can send with curl.
#include "discovery/etcd_client.h"

#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <array>
#include <mutex>

#include "common/text.h"

namespace kvbridge::discovery {
namespace {

// Bounds on what etcd may send back.
// An answer (a range page, a watch line) is at most this: a page of
// kListPage records of kMaxInstanceRecordBytes, base64, with room to spare.
// Parsing it takes a bounded multiple of it.
constexpr size_t kMaxAnswerBytes = size_t{16} << 20;
constexpr size_t kListPage = 64;
constexpr size_t kMaxListKeys = 65536;

constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

void global_init() {
  // curl_global_init is not thread-safe (libcurl-thread(3)): once, here.
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

// The gateway writes int64 fields as strings ("revision": "5") and leaves
// out fields that are zero.
int64_t get_int(const Json& j, const char* field) {
  if (!j.is_object()) return 0;
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (...) {
      return 0;
    }
  }
  return 0;
}

std::string get_string(const Json& j, const char* field) {
  if (!j.is_object()) return {};
  auto it = j.find(field);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

// etcd's error as a Status: its gRPC code (google.golang.org/grpc/codes)
// mapped onto ours, its message kept.
Status etcd_error(const std::string& where, const Json& answer, long http) {
  const std::string message =
      get_string(answer, "message").empty() ? get_string(answer, "error") : get_string(answer, "message");
  const std::string text = where + ": " + (message.empty() ? "HTTP " + std::to_string(http) : message);
  switch (get_int(answer, "code")) {
    case 3:  // InvalidArgument
    case 9:  // FailedPrecondition
      return Status::invalid_argument(text);
    case 5:
      return Status::not_found(text);
    case 6:
      return Status::already_exists(text);
    case 7:
    case 16:
      return Status::permission_denied(text);
    case 8:
      return Status::resource_exhausted(text);
    case 11:  // OutOfRange: a revision compacted away
      return Status::out_of_range(text);
    default:
      return Status::unavailable(text);
  }
}

size_t append_bounded(char* data, size_t size, size_t n, void* user) {
  auto* out = static_cast<std::string*>(user);
  if (out->size() + size * n > kMaxAnswerBytes) return 0;  // curl reports a write error
  out->append(data, size * n);
  return size * n;
}

// TCP keepalive probes after 2 s idle, every 1 s, 3 of them: a watch on a
// host that vanished (no RST) breaks within about 5 s. libcurl 7.88 sets
// the first two but not the count.
int set_keepalive_count(void*, curl_socket_t fd, curlsocktype) {
  const int count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  return CURL_SOCKOPT_OK;
}

void common_options(CURL* c, const std::string& url, const std::string& body, curl_slist* headers,
                    const EtcdOptions& o) {
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_POST, 1L);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.data());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  // No signals from a library (timeouts in threads, libcurl-thread(3)); no
  // proxy from the environment: etcd is on the internal network.
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_PROXY, "");
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(o.connect_timeout.count()));
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(v >> s) & 63];
  }
  if (i < bytes.size()) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    if (i + 1 < bytes.size()) v |= uint8_t(bytes[i + 1]) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

Result<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return Status::invalid_argument("base64 of " + std::to_string(text.size()) + " characters");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = text[i + k];
      if (c == '=' && i + 4 == text.size() && k >= 2) {
        ++pad;
        v <<= 6;
        continue;
      }
      const size_t d = pad ? std::string_view::npos : kAlphabet.find(c);
      if (d == std::string_view::npos)
        return Status::invalid_argument("not base64 at character " + std::to_string(i + k));
      v = (v << 6) | uint32_t(d);
    }
    out += char(v >> 16);
    if (pad < 2) out += char((v >> 8) & 0xff);
    if (pad < 1) out += char(v & 0xff);
  }
  return out;
}

std::string prefix_end(std::string prefix) {
  // etcd's clientv3.GetPrefixRangeEnd: increment the last byte below 0xff.
  while (!prefix.empty()) {
    if (uint8_t(prefix.back()) < 0xff) {
      prefix.back() = char(uint8_t(prefix.back()) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Status check_options(const EtcdOptions& o) {
  const std::string_view e = o.endpoint;
  const size_t scheme = e.starts_with("http://") ? 7 : e.starts_with("https://") ? 8 : 0;
  if (scheme == 0 || e.size() == scheme) {
    return Status::invalid_argument("etcd endpoint '" + o.endpoint + "' is not http://host:port");
  }
  for (char c : e) {
    if (c <= ' ' || c > '~')
      return Status::invalid_argument("etcd endpoint '" + o.endpoint + "' has a space or control");
  }
  if (o.prefix.empty() || o.prefix.front() != '/' || o.prefix.back() == '/' || o.prefix.size() > 512) {
    return Status::invalid_argument("etcd prefix '" + o.prefix +
                                    "' must start with '/', not end with '/', and be at most 512 bytes");
  }
  for (char c : o.prefix) {
    if (c <= ' ' || c > '~') return Status::invalid_argument("etcd prefix '" + o.prefix + "' has a space or control");
  }
  if (o.connect_timeout.count() <= 0 || o.request_timeout.count() <= 0) {
    return Status::invalid_argument("etcd connect_timeout and request_timeout must be positive");
  }
  return Status();
}

EtcdClient::EtcdClient(EtcdOptions options) : options_(std::move(options)) {
  while (options_.endpoint.ends_with('/')) options_.endpoint.pop_back();
  global_init();
  easy_ = curl_easy_init();
  multi_ = curl_multi_init();
}

EtcdClient::~EtcdClient() {
  if (easy_) curl_easy_cleanup(static_cast<CURL*>(easy_));
  if (multi_) curl_multi_cleanup(static_cast<CURLM*>(multi_));
}

Status EtcdClient::unavailable(std::string_view path, std::string_view why) const {
  return Status::unavailable("etcd at " + options_.endpoint + ": " + std::string(path) + ": " + std::string(why));
}

Result<Json> EtcdClient::call(std::string_view path, const Json& body) {
  CURL* c = static_cast<CURL*>(easy_);
  if (!c) return unavailable(path, "libcurl could not start");
  const std::string url = options_.endpoint + std::string(path);
  const std::string request = body.dump();
  std::string answer;
  std::array<char, CURL_ERROR_SIZE> error{};
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  // Reset keeps the connection cache: calls after the first reuse the connection.
  curl_easy_reset(c);
  common_options(c, url, request, headers, options_);
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.request_timeout.count()));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, append_bounded);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &answer);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error.data());
  const CURLcode rc = curl_easy_perform(c);
  curl_slist_free_all(headers);
  if (rc != CURLE_OK) {
    if (rc == CURLE_WRITE_ERROR) return unavailable(path, "answer larger than 16 MiB");
    return unavailable(path, error[0] ? error.data() : curl_easy_strerror(rc));
  }
  long http = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
  Json j = Json::parse(answer, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return unavailable(path, "HTTP " + std::to_string(http) + " with an answer that is not a JSON object");
  }
  if (http != 200 || j.contains("error"))
    return etcd_error("etcd at " + options_.endpoint + ": " + std::string(path), j, http);
  return j;
}

Result<int64_t> EtcdClient::grant(std::chrono::seconds ttl) {
  KVB_ASSIGN_OR_RETURN(Json j, call("/v3/lease/grant", {{"TTL", std::to_string(ttl.count())}}));
  const int64_t id = get_int(j, "ID");
  if (id == 0) return unavailable("/v3/lease/grant", "no lease ID in the answer");
  return id;
}

Result<int64_t> EtcdClient::keepalive(int64_t lease) {
  // A stream in gRPC; through the gateway, one request gives one answer
  // {"result": {"ID": ..., "TTL": ...}}, TTL left out when the lease is gone.
  KVB_ASSIGN_OR_RETURN(Json j, call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}));
  return get_int(j.contains("result") ? j["result"] : j, "TTL");
}

Status EtcdClient::revoke(int64_t lease) { return call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}).status(); }

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  Json body = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  return call("/v3/kv/put", body).status();
}

Result<std::vector<KeyValue>> EtcdClient::list(const std::string& prefix, int64_t* revision) {
  // In pages of kListPage keys, each at the first page's revision (one
  // snapshot): no answer is larger than a page of records can be, however
  // many there are, and an etcd that answers more than it was asked for, or
  // keys outside the range or out of order, is not believed.
  const std::string end = prefix_end(prefix);
  std::string from = prefix;
  int64_t at = 0;
  std::vector<KeyValue> out;
  for (;;) {
    Json body = {{"key", base64_encode(from)}, {"range_end", base64_encode(end)}, {"limit", std::to_string(kListPage)}};
    if (at != 0) body["revision"] = std::to_string(at);
    KVB_ASSIGN_OR_RETURN(Json j, call("/v3/kv/range", body));
    if (at == 0) at = get_int(j.value("header", Json::object()), "revision");
    auto kvs = j.find("kvs");
    const size_t n = kvs != j.end() && kvs->is_array() ? kvs->size() : 0;
    if (n > kListPage) {
      return unavailable("/v3/kv/range",
                         "answered " + std::to_string(n) + " keys to a page of " + std::to_string(kListPage));
    }
    for (size_t i = 0; i < n; ++i) {
      const Json& kv = (*kvs)[i];
      KVB_ASSIGN_OR_RETURN(std::string key, base64_decode(get_string(kv, "key")));
      KVB_ASSIGN_OR_RETURN(std::string value, base64_decode(get_string(kv, "value")));
      if (key < from || key >= end || (!out.empty() && key <= out.back().key)) {
        return unavailable("/v3/kv/range", "answered a key outside the range asked for, or out of order");
      }
      out.push_back({std::move(key), std::move(value), get_int(kv, "mod_revision")});
    }
    if (out.size() > kMaxListKeys) {
      return Status::resource_exhausted("etcd at " + options_.endpoint + ": more than " + std::to_string(kMaxListKeys) +
                                        " keys under " + q(printable(prefix)));
    }
    if (n < kListPage || !j.value("more", false)) break;
    from = out.back().key + std::string(1, '\0');
  }
  if (revision) *revision = at;
  return out;
}

namespace {

struct WatchState {
  std::string buffer;
  bool created = false;
  Status status;  // set by the write callback when it ends the stream
  const std::function<void()>* on_created = nullptr;
  const std::function<bool(const std::vector<WatchEvent>&)>* on_events = nullptr;
  std::string where;
};

// One line of the stream: {"result": {...}} or {"error": ...}. False ends it.
bool on_line(WatchState& w, std::string_view line) {
  Json j = Json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    w.status = Status::unavailable(w.where + ": a watch answer that is not a JSON object");
    return false;
  }
  if (j.contains("error")) {
    w.status = etcd_error(w.where, j.contains("error") && j["error"].is_object() ? j["error"] : j, 200);
    return false;
  }
  const Json r = j.value("result", Json::object());
  if (r.value("created", false)) {
    w.created = true;
    if (*w.on_created) (*w.on_created)();
  }
  if (r.value("canceled", false)) {
    if (get_int(r, "compact_revision") > 0) {
      w.status = Status::out_of_range(w.where + ": compacted past the watch's revision (now at " +
                                      std::to_string(get_int(r, "compact_revision")) + ")");
    } else {
      w.status = Status::unavailable(w.where + ": watch cancelled: " + get_string(r, "cancel_reason"));
    }
    return false;
  }
  auto events = r.find("events");
  if (events == r.end() || !events->is_array() || events->empty()) return true;
  std::vector<WatchEvent> batch;
  for (const Json& e : *events) {
    WatchEvent ev;
    ev.deleted = get_string(e, "type") == "DELETE";
    const Json kv = e.value("kv", Json::object());
    Result<std::string> key = base64_decode(get_string(kv, "key"));
    Result<std::string> value = base64_decode(get_string(kv, "value"));
    if (!key.ok() || !value.ok()) {
      w.status = Status::unavailable(w.where + ": a watch event whose key or value is not base64");
      return false;
    }
    ev.kv = {std::move(*key), std::move(*value), get_int(kv, "mod_revision")};
    batch.push_back(std::move(ev));
  }
  if (!(*w.on_events)(batch)) {
    w.status = Status::cancelled(w.where + ": stopped by its reader");
    return false;
  }
  return true;
}

size_t on_watch_bytes(char* data, size_t size, size_t n, void* user) {
  auto& w = *static_cast<WatchState*>(user);
  w.buffer.append(data, size * n);
  size_t start = 0;
  for (size_t nl; (nl = w.buffer.find('\n', start)) != std::string::npos; start = nl + 1) {
    const std::string_view line(w.buffer.data() + start, nl - start);
    if (line.find_first_not_of(" \r\t") == std::string_view::npos) continue;
    if (!on_line(w, line)) return 0;
  }
  w.buffer.erase(0, start);
  if (w.buffer.size() > kMaxAnswerBytes) {
    w.status = Status::unavailable(w.where + ": a watch answer larger than 16 MiB");
    return 0;
  }
  return size * n;
}

}  // namespace

Status EtcdClient::watch(const std::string& prefix, int64_t start_revision, const std::function<void()>& on_created,
                         const std::function<bool(const std::vector<WatchEvent>&)>& on_events) {
  CURLM* m = static_cast<CURLM*>(multi_);
  CURL* c = curl_easy_init();
  if (!m || !c) {
    if (c) curl_easy_cleanup(c);
    return unavailable("/v3/watch", "libcurl could not start");
  }
  WatchState w;
  w.on_created = &on_created;
  w.on_events = &on_events;
  w.where = "etcd at " + options_.endpoint + ": /v3/watch";
  const std::string url = options_.endpoint + "/v3/watch";
  const Json body = {{"create_request",
                      {{"key", base64_encode(prefix)},
                       {"range_end", base64_encode(prefix_end(prefix))},
                       {"start_revision", std::to_string(start_revision)}}}};
  const std::string request = body.dump();
  std::array<char, CURL_ERROR_SIZE> error{};
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  common_options(c, url, request, headers, options_);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_watch_bytes);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &w);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error.data());
  curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(c, CURLOPT_TCP_KEEPIDLE, 2L);
  curl_easy_setopt(c, CURLOPT_TCP_KEEPINTVL, 1L);
  curl_easy_setopt(c, CURLOPT_SOCKOPTFUNCTION, set_keepalive_count);
  curl_multi_add_handle(m, c);

  // The multi interface so that interrupt() (curl_multi_wakeup) ends the
  // wait at once; an easy handle's progress callback runs only about once a
  // second when nothing moves.
  const auto created_by = std::chrono::steady_clock::now() + options_.connect_timeout + options_.request_timeout;
  Status result;
  CURLcode done = CURLE_OK;
  bool finished = false;
  while (!interrupted_.load()) {
    int running = 0;
    curl_multi_perform(m, &running);
    int left = 0;
    while (CURLMsg* msg = curl_multi_info_read(m, &left)) {
      if (msg->msg == CURLMSG_DONE) {
        done = msg->data.result;
        finished = true;
      }
    }
    if (finished || running == 0) break;
    if (!w.created && std::chrono::steady_clock::now() > created_by) {
      result = unavailable("/v3/watch", "no answer to the watch request in time");
      break;
    }
    curl_multi_poll(m, nullptr, 0, 200, nullptr);
  }
  curl_multi_remove_handle(m, c);
  curl_easy_cleanup(c);
  curl_slist_free_all(headers);
  if (!result.ok()) return result;
  if (interrupted_.load()) return Status::cancelled("etcd watch interrupted");
  if (!w.status.ok()) return w.status;
  if (done != CURLE_OK) return unavailable("/v3/watch", error[0] ? error.data() : curl_easy_strerror(done));
  // An error answer (an older etcd without /v3/watch, say) may end without a newline.
  if (w.buffer.find_first_not_of(" \r\n\t") != std::string::npos && !on_line(w, w.buffer)) return w.status;
  return unavailable("/v3/watch", "the stream ended");
}

void EtcdClient::interrupt() {
  interrupted_.store(true);
  if (multi_) curl_multi_wakeup(static_cast<CURLM*>(multi_));
}

}  // namespace kvbridge::discovery
