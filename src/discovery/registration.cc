// Registration: a record under a lease, kept alive (kvbridge/discovery.h).
#include <condition_variable>
#include <mutex>
#include <thread>

#include "discovery/etcd_client.h"
#include "kvbridge/discovery.h"

namespace kvbridge {
namespace {

using discovery::EtcdClient;
using namespace std::chrono_literals;

class RegistrationImpl final : public Registration {
 public:
  RegistrationImpl(const EtcdOptions& options, std::string key, std::string value, std::chrono::seconds ttl)
      : client_(options), key_(std::move(key)), value_(std::move(value)), ttl_(ttl) {}

  ~RegistrationImpl() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (!thread_.joinable()) return;  // start() failed and cleaned up
    thread_.join();
    // Revoking deletes the key at once; a watcher sees it go now rather than
    // after the TTL. Bounded by the request timeout when etcd is away.
    (void)client_.revoke(lease_.load());
  }

  Status start() {
    KVB_ASSIGN_OR_RETURN(int64_t lease, client_.grant(ttl_));
    lease_.store(lease);
    Status put = client_.put(key_, value_, lease);
    if (!put.ok()) {
      (void)client_.revoke(lease);
      return put;
    }
    thread_ = std::thread([this] { run(); });
    return Status();
  }

  const std::string& key() const override { return key_; }
  int64_t lease() const override { return lease_.load(); }
  Status health() const override {
    std::lock_guard<std::mutex> l(mu_);
    return health_;
  }
  uint64_t regrants() const override { return regrants_.load(); }

 private:
  // Renews every ttl/3: two renewals can fail before the key expires. While
  // etcd cannot be reached it retries more often, so that the key is back
  // soon after etcd is.
  void run() {
    const std::chrono::milliseconds period = std::chrono::duration_cast<std::chrono::milliseconds>(ttl_) / 3;
    const std::chrono::milliseconds retry = std::min(period, std::chrono::milliseconds(500));
    bool healthy = true;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        if (cv_.wait_for(l, healthy ? period : retry, [this] { return stop_; })) return;
      }
      Status s = renew(healthy);
      healthy = s.ok();
      std::lock_guard<std::mutex> l(mu_);
      health_ = s;
    }
  }

  // One renewal. After a failure (etcd stopped, restarted, unreachable),
  // the key is written again: a restarted etcd keeps leases and keys from
  // its data dir, but one restored from elsewhere or a lease revoked by
  // someone else would leave it missing.
  Status renew(bool was_healthy) {
    const int64_t lease = lease_.load();
    KVB_ASSIGN_OR_RETURN(int64_t left, client_.keepalive(lease));
    if (left > 0) {
      if (!was_healthy) KVB_RETURN_IF_ERROR(client_.put(key_, value_, lease));
      return Status();
    }
    // The lease is gone (expired while this process was stopped or cut
    // off, or revoked): grant a new one and write the key under it.
    KVB_ASSIGN_OR_RETURN(int64_t fresh, client_.grant(ttl_));
    lease_.store(fresh);
    regrants_.fetch_add(1);
    return client_.put(key_, value_, fresh);
  }

  EtcdClient client_;
  const std::string key_, value_;
  const std::chrono::seconds ttl_;
  std::atomic<int64_t> lease_{0};
  std::atomic<uint64_t> regrants_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  Status health_;
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Registration>> Registration::create(const EtcdOptions& options, const InstanceRecord& record,
                                                           std::chrono::seconds ttl) {
  KVB_RETURN_IF_ERROR(discovery::check_options(options));
  if (ttl < 2s)
    return Status::invalid_argument("registration TTL of " + std::to_string(ttl.count()) +
                                    " s is under etcd's minimum of 2 s");
  KVB_ASSIGN_OR_RETURN(std::string value, instance_record_to_json(record, options.secret));
  auto r = std::make_unique<RegistrationImpl>(options, instance_key(options, record.id), std::move(value), ttl);
  KVB_RETURN_IF_ERROR(r->start());
  return std::unique_ptr<Registration>(std::move(r));
}

}  // namespace kvbridge
