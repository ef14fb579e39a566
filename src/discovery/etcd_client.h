// discovery/etcd_client.h: the few etcd v3 calls discovery needs, through
// etcd's JSON gateway (POST /v3/...) with libcurl.
//
// Keys and values travel base64-encoded and 64-bit integers as decimal
// strings (the gateway's protobuf-to-JSON mapping). A unary call is bounded
// by the options' connect and request timeouts; a watch is a stream of
// newline-delimited JSON objects that runs until it breaks or is
// interrupted.
//
// Thread-safety: an EtcdClient has one owner at a time, except interrupt(),
// which any thread may call. Ownership: it owns its curl handles.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvbridge/discovery.h"
#include "kvbridge/status.h"

namespace kvbridge::discovery {

using Json = nlohmann::json;

std::string base64_encode(std::string_view bytes);
// kInvalidArgument for text that is not base64.
Result<std::string> base64_decode(std::string_view text);
// The first key after every key that starts with `prefix` (etcd's range_end
// for a prefix).
std::string prefix_end(std::string prefix);
// OK, or kInvalidArgument naming what is wrong with the endpoint or prefix.
Status check_options(const EtcdOptions& options);

struct KeyValue {
  std::string key, value;
  int64_t mod_revision = 0;
};

struct WatchEvent {
  bool deleted = false;
  KeyValue kv;
};

class EtcdClient {
 public:
  explicit EtcdClient(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  const EtcdOptions& options() const { return options_; }

  // POSTs `body` to `path` ("/v3/kv/range"); returns the parsed answer.
  // kUnavailable ("etcd at <endpoint>: <path>: <why>") when etcd cannot be
  // reached or answers nothing in time; etcd's own errors mapped from their
  // gRPC code, with etcd's message.
  Result<Json> call(std::string_view path, const Json& body);

  Result<int64_t> grant(std::chrono::seconds ttl);
  // The lease's remaining TTL in seconds: 0 when etcd does not know it.
  Result<int64_t> keepalive(int64_t lease);
  Status revoke(int64_t lease);
  Status put(const std::string& key, const std::string& value, int64_t lease);
  // Every key starting with `prefix`, and the store's revision they are from.
  Result<std::vector<KeyValue>> list(const std::string& prefix, int64_t* revision);

  // Watches keys starting with `prefix` from `start_revision` and calls
  // `on_events` for each batch, until the stream breaks (kUnavailable, or
  // kOutOfRange when etcd compacted past `start_revision`), `on_events`
  // returns false, or interrupt() is called (kCancelled). `on_created` runs
  // once the watch is established.
  Status watch(const std::string& prefix, int64_t start_revision, const std::function<void()>& on_created,
               const std::function<bool(const std::vector<WatchEvent>&)>& on_events);
  // Ends a watch in progress at once, and every later one; any thread.
  void interrupt();

 private:
  Status unavailable(std::string_view path, std::string_view why) const;
  EtcdOptions options_;
  void* easy_ = nullptr;   // CURL*, for unary calls
  void* multi_ = nullptr;  // CURLM*, for the watch (interruptible)
  std::atomic<bool> interrupted_{false};
};

}  // namespace kvbridge::discovery
