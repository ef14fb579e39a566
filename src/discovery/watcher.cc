// Watcher: list, watch, resync (kvbridge/discovery.h).
#include <condition_variable>
#include <mutex>
#include <thread>

#include "common/text.h"
#include "discovery/etcd_client.h"
#include "kvbridge/discovery.h"

namespace kvbridge {
namespace {

using discovery::EtcdClient;
using discovery::KeyValue;
using discovery::WatchEvent;
using namespace std::chrono_literals;

using Records = std::map<std::string, InstanceRecord>;
struct Change {
  InstanceEvent event;
  InstanceRecord record;
};

class WatcherImpl final : public Watcher {
 public:
  WatcherImpl(const EtcdOptions& options, InstanceCallback callback)
      : client_(options), dir_(instance_key(options, "")), secret_(options.secret), callback_(std::move(callback)) {}

  ~WatcherImpl() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    client_.interrupt();  // ends an open watch at once
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  // The first listing, on the caller's thread, so that an unreachable etcd
  // is create()'s error; its records are reported by the thread.
  Status start() {
    int64_t revision = 0;
    std::vector<Change> changes;
    KVB_RETURN_IF_ERROR(resync(&revision, &changes));
    thread_ =
        std::thread([this, revision, changes = std::move(changes)]() mutable { run(revision, std::move(changes)); });
    return Status();
  }

  Records instances() const override {
    std::lock_guard<std::mutex> l(mu_);
    return records_;
  }

  Result<InstanceRecord> wait_for(const std::string& id, std::chrono::milliseconds timeout) const override {
    std::unique_lock<std::mutex> l(mu_);
    if (!changed_.wait_for(l, timeout, [&] { return records_.contains(id); })) {
      return Status::timeout("instance '" + id + "' did not appear under " + dir_ + " within " +
                             std::to_string(timeout.count()) + " ms");
    }
    return records_.at(id);
  }

  Status wait_gone(const std::string& id, std::chrono::milliseconds timeout) const override {
    std::unique_lock<std::mutex> l(mu_);
    if (!changed_.wait_for(l, timeout, [&] { return !records_.contains(id); })) {
      return Status::timeout("instance '" + id + "' was still under " + dir_ + " after " +
                             std::to_string(timeout.count()) + " ms");
    }
    return Status();
  }

  Status health() const override {
    std::lock_guard<std::mutex> l(mu_);
    return health_;
  }
  uint64_t resyncs() const override { return resyncs_.load(); }
  uint64_t invalid_records() const override { return invalid_.load(); }
  Status last_invalid() const override {
    std::lock_guard<std::mutex> l(invalid_mu_);
    return last_invalid_;
  }

 private:
  // The record under `key`, or nullopt (counted) for one that is not valid
  // or whose id is not its key's last segment.
  std::optional<InstanceRecord> decode(const KeyValue& kv) {
    Result<InstanceRecord> r = parse_instance_record(kv.value, secret_);
    if (!r.ok() || kv.key != dir_ + r->id) {
      invalid_.fetch_add(1);
      std::lock_guard<std::mutex> l(invalid_mu_);
      last_invalid_ =
          (r.ok() ? Status::invalid_argument("instance record '" + r->id + "' is not its key's") : r.error())
              .with_context("etcd key " + q(printable(kv.key)));
      return std::nullopt;
    }
    return std::move(*r);
  }

  // Applies one key's new state and notes the change, if any.
  void apply(Records& records, const std::string& key, std::optional<InstanceRecord> record,
             std::vector<Change>* changes) {
    const std::string id = key.substr(dir_.size());
    auto it = records.find(id);
    if (!record) {
      if (it == records.end()) return;
      changes->push_back({InstanceEvent::kRemoved, std::move(it->second)});
      records.erase(it);
    } else if (it == records.end()) {
      changes->push_back({InstanceEvent::kAdded, *record});
      records.emplace(id, std::move(*record));
    } else if (!(it->second == *record)) {
      changes->push_back({InstanceEvent::kChanged, *record});
      it->second = std::move(*record);
    }
  }

  // Lists the prefix and notes the difference with what is known: whatever
  // happened while the watch was down (keys added, removed or changed, any
  // number of times) shows up here once.
  Status resync(int64_t* revision, std::vector<Change>* changes) {
    KVB_ASSIGN_OR_RETURN(std::vector<KeyValue> kvs, client_.list(dir_, revision));
    Records now;
    std::vector<Change> ignored;
    for (const KeyValue& kv : kvs) {
      // etcd answers only keys under the prefix asked for; one that lies is
      // not believed.
      if (kv.key.starts_with(dir_)) apply(now, kv.key, decode(kv), &ignored);
    }
    std::lock_guard<std::mutex> l(mu_);
    Records before = records_;
    for (auto& [id, r] : before) {
      if (!now.contains(id)) apply(records_, dir_ + id, std::nullopt, changes);
    }
    for (auto& [id, r] : now) apply(records_, dir_ + id, r, changes);
    health_ = Status();
    changed_.notify_all();
    return Status();
  }

  void report(std::vector<Change>& changes) {
    if (!callback_) return;
    for (const Change& c : changes) callback_(c.event, c.record);
  }

  bool sleep(std::chrono::milliseconds d) {
    std::unique_lock<std::mutex> l(mu_);
    return !cv_.wait_for(l, d, [this] { return stop_; });
  }

  void set_health(Status s) {
    std::lock_guard<std::mutex> l(mu_);
    health_ = std::move(s);
  }

  void run(int64_t revision, std::vector<Change> initial) {
    report(initial);
    auto backoff = 100ms;
    for (;;) {
      // Watches from just after the listing: every change after it arrives.
      Status s = client_.watch(
          dir_, revision + 1, [&] { backoff = 100ms; },
          [&](const std::vector<WatchEvent>& events) {
            std::vector<Change> changes;
            {
              std::lock_guard<std::mutex> l(mu_);
              for (const WatchEvent& e : events) {
                if (!e.kv.key.starts_with(dir_)) continue;
                apply(records_, e.kv.key, e.deleted ? std::nullopt : decode(e.kv), &changes);
                revision = std::max(revision, e.kv.mod_revision);
              }
              changed_.notify_all();
            }
            report(changes);
            return true;
          });
      if (s.code() == Code::kCancelled) return;  // interrupted: the destructor
      set_health(s);
      // Reconnect: back off, list again, report what changed meanwhile.
      for (;;) {
        if (!sleep(backoff)) return;
        backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
        std::vector<Change> changes;
        Status r = resync(&revision, &changes);
        if (r.ok()) {
          resyncs_.fetch_add(1);
          report(changes);
          break;
        }
        set_health(r);
      }
    }
  }

  EtcdClient client_;
  const std::string dir_;  // "<prefix>/instances/"
  const std::string secret_;
  InstanceCallback callback_;
  mutable std::mutex mu_;
  mutable std::condition_variable changed_;  // records_ changed
  std::condition_variable cv_;               // stop_
  bool stop_ = false;
  Records records_;
  Status health_;
  mutable std::mutex invalid_mu_;  // after mu_ when both are held
  Status last_invalid_;
  std::atomic<uint64_t> resyncs_{0}, invalid_{0};
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Watcher>> Watcher::create(const EtcdOptions& options, InstanceCallback callback) {
  KVB_RETURN_IF_ERROR(discovery::check_options(options));
  auto w = std::make_unique<WatcherImpl>(options, std::move(callback));
  KVB_RETURN_IF_ERROR(w->start());
  return std::unique_ptr<Watcher>(std::move(w));
}

}  // namespace kvbridge
