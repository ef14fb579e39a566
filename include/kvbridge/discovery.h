// kvbridge/discovery.h: finding instances through etcd (optional).
//
// An instance publishes an InstanceRecord (its role, each rank's side
// channel address, its layout identity hash and protocol version) under
// `<prefix>/instances/<id>` in etcd v3, attached to a lease that a
// Registration keeps alive; when the process dies the lease expires and the
// key vanishes. A Watcher lists the prefix, then watches it, and keeps the
// current set of instances, reporting additions, removals and changes.
// Discovery is never required: ConnectorWorker::add_remote() with static
// addresses works without etcd, and the connector does not depend on this
// layer (kvbridge/discovery_sync.h joins the two). docs/discovery.md has the
// keys, the record format and the failure semantics.
//
// etcd is spoken to through its JSON gateway over HTTP (libcurl): every
// call has a connect timeout and a request timeout, so nothing here hangs on
// an etcd that is unreachable or stopped.
//
// Errors: kUnavailable naming the endpoint when etcd cannot be reached or
// does not answer in time; kInvalidArgument for bad options or records,
// naming the field; what etcd itself reports (an unknown lease, a bad
// request) with its message.
//
// Thread-safety: InstanceRecord and the free functions are values and pure.
// Every method of Registration and Watcher may be called from any thread.
// Ownership: a Registration owns its lease (revoked when destroyed) and its
// keepalive thread; a Watcher owns its thread and its callback, which never
// runs after the Watcher's destructor returns.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge {

// ---------------------------------------------------------------------------
// The record.

inline constexpr std::string_view kInstanceRecordFormat = "kvbridge.instance/1";
// A record's JSON is at most this long; longer input is refused before parsing.
inline constexpr size_t kMaxInstanceRecordBytes = 64 * 1024;
inline constexpr size_t kMaxInstanceIdBytes = 128;
inline constexpr size_t kMaxInstanceRanks = 4096;
inline constexpr size_t kMaxInstanceLabels = 64;

// What an instance publishes. Every field is checked by
// check_instance_record() (and so by parsing and serializing):
struct InstanceRecord {
  // 1 to 128 bytes of [A-Za-z0-9._:-]: the last segment of its key, and the
  // instance name ConnectorWorker::add_remote() is given.
  std::string id;
  std::string role;  // "prefill" or "decode"
  // Each rank's side channel (ConnectorWorker::side_channel_address(),
  // host:port), in rank order (Layout::rank()); 1 to 4096 of them.
  std::vector<std::string> ranks;
  // The layout identity hash the handshake compares: 16 lower-case hex
  // digits (compatibility_hash_hex(), layout.h).
  std::string identity;
  // The side channel's handshake version, 1 to 65535.
  uint32_t protocol = 0;
  // Free-form: keys of 1 to 63 bytes of [A-Za-z0-9._/-], values of at most
  // 256 bytes of printable ASCII; at most 64 of them.
  std::map<std::string, std::string> labels;

  bool operator==(const InstanceRecord&) const = default;
};

// OK, or kInvalidArgument naming the first bad field ("instance record field
// 'ranks[2]': ...").
Status check_instance_record(const InstanceRecord& record);
// The record as one line of JSON (keys sorted, "format" first among them in
// meaning only). kInvalidArgument when check_instance_record() fails.
//
// With a deployment's shared secret (the one its engines and workers hold)
// the record is signed: a "mac" field, HMAC-SHA256 under the secret over the
// record's canonical JSON (the line without "mac"), in hex. A watcher given
// the secret takes only records signed with it, so a writer to etcd without
// the secret cannot point an instance's name at other addresses.
Result<std::string> instance_record_to_json(const InstanceRecord& record, std::string_view secret = {});
// Parses what a peer wrote: at most kMaxInstanceRecordBytes, one object with
// exactly the fields above and an optional "mac" (unknown and repeated
// fields refused), then checked. kResourceExhausted past the size bound,
// kIncompatible for another "format", kInvalidArgument naming the field
// otherwise. With a `secret`: kPermissionDenied for a record without a
// "mac" or whose "mac" is not the record's under that secret. Without one a
// "mac" is not checked (nothing binds the record then).
Result<InstanceRecord> parse_instance_record(std::string_view json, std::string_view secret = {});

// ---------------------------------------------------------------------------
// etcd.

struct EtcdOptions {
  // etcd's client URL: http://host:port (https:// also works; no client
  // certificates or etcd authentication are configured).
  std::string endpoint = "http://127.0.0.1:2379";
  // Keys live under `<prefix>/instances/`; starts with '/', no trailing '/'.
  std::string prefix = "/kvbridge";
  std::chrono::milliseconds connect_timeout{1000};
  // Each unary call (grant, keepalive, put, range, revoke) ends within this.
  std::chrono::milliseconds request_timeout{3000};
  // The deployment's shared secret (WorkerOptions::secret), or empty. Set, a
  // Registration signs its record and a Watcher skips (and counts in
  // invalid_records()) every record not signed with it.
  std::string secret;
};

// `<prefix>/instances/<id>`.
std::string instance_key(const EtcdOptions& options, std::string_view id);

// One record kept in etcd under a lease while this object lives.
//
// A background thread renews the lease every ttl/3. When etcd cannot be
// reached it retries every min(ttl/3, 500 ms) and health() says why; once
// etcd answers again it writes the key again (under the same lease if etcd
// still has it, else under a newly granted one), so a registration comes
// back after an etcd restart or a lost lease by itself.
class Registration {
 public:
  // Grants a lease of `ttl` (at least 2 s: etcd's minimum) and writes the
  // record, before returning. kInvalidArgument for a bad record, options or
  // ttl; kUnavailable naming the endpoint when etcd cannot be reached within
  // the options' timeouts.
  static Result<std::unique_ptr<Registration>> create(const EtcdOptions& options, const InstanceRecord& record,
                                                      std::chrono::seconds ttl = std::chrono::seconds(10));
  // Stops the thread and revokes the lease, so the key vanishes at once
  // (bounded by request_timeout; if etcd is unreachable the key expires
  // with the lease instead).
  virtual ~Registration() = default;

  virtual const std::string& key() const = 0;
  // The lease the key is attached to now (it changes when re-granted).
  virtual int64_t lease() const = 0;
  // OK while the last renewal succeeded; else why not (kUnavailable ...).
  virtual Status health() const = 0;
  // How many times the lease was lost and granted again.
  virtual uint64_t regrants() const = 0;
};

enum class InstanceEvent : uint8_t { kAdded, kRemoved, kChanged };
std::string_view instance_event_name(InstanceEvent event);  // "added", "removed", "changed"

// The record is the new one (kAdded, kChanged) or the last one seen (kRemoved).
using InstanceCallback = std::function<void(InstanceEvent event, const InstanceRecord& record)>;

// The instances under a prefix, kept current.
//
// create() lists the prefix once (so an unreachable etcd is an error
// there); a thread then reports that listing as kAdded events and watches
// from the listing's revision, so no change is missed. When the watch
// breaks (etcd stopped, restarted, compacted past the watch) it reconnects
// with backoff (100 ms doubling to 2 s), lists again and reports the
// difference with what it had, then watches from the new listing.
// A value under the prefix that is not a valid record whose id is its key's
// last segment (or, with EtcdOptions::secret, is not signed with it) is
// skipped (and, if its key held a valid record before,
// reported as kRemoved); invalid_records() counts them.
//
// The callback runs on the watcher's thread, one event at a time, in the
// order etcd applied the changes; it may call instances() and wait_for()
// but must not destroy the Watcher. instances() may show a change just
// before its callback runs.
class Watcher {
 public:
  // kInvalidArgument for bad options; kUnavailable naming the endpoint when
  // the first listing fails within the options' timeouts.
  static Result<std::unique_ptr<Watcher>> create(const EtcdOptions& options, InstanceCallback callback = nullptr);
  // Stops the thread (an open watch is interrupted at once); no callback
  // runs after it returns.
  virtual ~Watcher() = default;

  // The current instances by id.
  virtual std::map<std::string, InstanceRecord> instances() const = 0;
  // The record of `id` once it is present; kTimeout after `timeout`.
  virtual Result<InstanceRecord> wait_for(const std::string& id, std::chrono::milliseconds timeout) const = 0;
  // Until `id` is absent: OK, or kTimeout after `timeout`.
  virtual Status wait_gone(const std::string& id, std::chrono::milliseconds timeout) const = 0;
  // OK while watching; else why not (kUnavailable naming the endpoint).
  virtual Status health() const = 0;
  // Listings after the first (each reconnect lists again).
  virtual uint64_t resyncs() const = 0;
  virtual uint64_t invalid_records() const = 0;
  // Why the last skipped record was skipped (naming its key), or OK.
  virtual Status last_invalid() const = 0;
};

}  // namespace kvbridge
