#include "connector/announcer.h"

#include <algorithm>
#include <optional>

#include "common/text.h"
#include "connector/messages.h"

namespace kvbridge::connector {

using Clock = std::chrono::steady_clock;

void SendFailures::add(const Status& s) {
  std::lock_guard<std::mutex> lock(mu);
  ++failed;
  last_error = s.to_string();
}

Announcer::Announcer(Remotes& remotes, Resender& resender, std::vector<std::string> layers, std::vector<uint8_t> device,
                     std::chrono::milliseconds timeout, std::shared_ptr<SendFailures> failures,
                     std::function<void(const std::string&)> connect)
    : remotes_(remotes),
      resender_(resender),
      layers_(std::move(layers)),
      device_(std::move(device)),
      timeout_(timeout),
      failures_(std::move(failures)),
      connect_(std::move(connect)) {}

Result<std::vector<PeerId>> Announcer::readers_of(const std::string& instance) {
  std::shared_ptr<const Fetched> fetched = remotes_.fetched(instance);
  if (!fetched) return Status::unavailable("no handshake with " + instance + " yet");
  std::vector<PeerId> readers;
  for (size_t r = 0; r < fetched->infos.size(); ++r) {
    KVB_ASSIGN_OR_RETURN(PeerId p, remotes_.peer(instance, r));
    readers.push_back(p);
  }
  return readers;
}

Status Announcer::stream_to(RequestId request, const std::string& instance) {
  // Connected already: the engine connections are known, nothing is dialled.
  std::optional<std::vector<PeerId>> readers;
  if (remotes_.connected(instance)) {
    Result<std::vector<PeerId>> r = readers_of(instance);
    if (r.ok()) readers = std::move(*r);
  }
  Messages messages;
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Stream& s = streams_[request];
    if (!s.instance.empty() && s.instance != instance) {
      return Status::already_exists("request " + q(request) + " already streams to " + s.instance);
    }
    s.touched = Clock::now();
    if (!s.instance.empty()) return Status();  // again: nothing new
    s.instance = instance;
    acks = s.acks;
    if (readers) {
      s.readers = std::move(*readers);
      messages = take_announcements(request, s);
    } else {
      s.waiting = true;
      std::lock_guard<std::mutex> acks_lock(acks->mu);
      acks->connecting = true;
    }
  }
  if (!readers) {
    connect_(instance);  // connected() sends what waits
    return Status();
  }
  send(messages, acks);
  return Status();
}

void Announcer::connected(const std::string& instance, const Status& result) {
  Result<std::vector<PeerId>> readers = result.ok() ? readers_of(instance) : Result<std::vector<PeerId>>(result);
  std::vector<std::pair<Messages, std::shared_ptr<Acks>>> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [request, s] : streams_) {
      if (!s.waiting || s.instance != instance) continue;
      s.waiting = false;
      if (readers.ok()) {
        s.readers = *readers;
        out.emplace_back(take_announcements(request, s), s.acks);
      }
      std::lock_guard<std::mutex> acks_lock(s.acks->mu);
      s.acks->connecting = false;
      if (!readers.ok() && s.acks->first_error.ok()) {
        // Unavailable, whatever the cause's code: wait_for_save()'s own
        // timeout is the only kTimeout it returns.
        s.acks->first_error = Status::unavailable("request " + q(request) + ": cannot announce its layers to " +
                                                  instance + ": " + readers.error().to_string());
      }
      s.acks->cv.notify_all();
    }
  }
  for (const auto& [messages, acks] : out) send(messages, acks);
}

Status Announcer::save_layer(RequestId request, std::string_view layer, const Readiness& ready) {
  auto it = std::find(layers_.begin(), layers_.end(), layer);
  if (it == layers_.end()) return Status::invalid_argument("no layer " + q(layer) + " in this rank's layout");
  if (ready.event_handle.size() > kMaxEventHandleBytes) {
    return Status::invalid_argument("layer " + q(layer) + ": the ready event handle is " +
                                    std::to_string(ready.event_handle.size()) + " bytes, more than " +
                                    std::to_string(kMaxEventHandleBytes));
  }
  if (device_[static_cast<size_t>(it - layers_.begin())] != 0 && ready.event_handle.empty() &&
      !ready.host_synchronized) {
    // The kernels that write the layer may still be queued: a reader in
    // another process must wait for them on its device, which it can only
    // do with an interprocess event.
    return Status::invalid_argument(
        "layer " + q(layer) + " of request " + q(request) +
        " is device memory: save_layer needs the IPC handle of an interprocess event recorded after the kernels "
        "that wrote it (Readiness::event_handle), or host_synchronized once the host waited for them");
  }
  Messages messages;
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Stream& s = streams_[request];
    s.touched = Clock::now();
    for (const auto& [saved, event] : s.saved) {
      if (saved == layer) return Status();
    }
    s.saved.emplace_back(std::string(layer), ready.host_synchronized ? std::string() : ready.event_handle);
    if (!s.instance.empty() && !s.waiting) messages = take_announcements(request, s);
    acks = s.acks;
  }
  send(messages, acks);
  return Status();
}

Status Announcer::wait_for_save(RequestId request, std::chrono::milliseconds timeout) {
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(request);
    if (it == streams_.end() || it->second.instance.empty()) {
      return Status::not_found("request " + q(request) + " was never streamed (stream_to)");
    }
    acks = it->second.acks;
  }
  Status out;
  {
    std::unique_lock<std::mutex> lock(acks->mu);
    auto settled = [&] { return acks->outstanding == 0 && !acks->connecting; };
    // A poll (0) looks without waiting: a timed wait of 0 still costs a
    // futex call and the timer slack (~50 us), per stream polled.
    if (timeout.count() <= 0 ? !settled() : !acks->cv.wait_for(lock, timeout, settled)) {
      if (acks->connecting) {
        return Status::timeout("request " + q(request) + ": not connected to the decode instance within " +
                               std::to_string(timeout.count()) + " ms");
      }
      return Status::timeout("request " + q(request) + ": " + std::to_string(acks->outstanding) +
                             " layer announcements not acknowledged within " + std::to_string(timeout.count()) + " ms");
    }
    out = acks->first_error;
  }
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(request);
  return out;
}

uint64_t Announcer::announcements_sent() const { return sent_.load(std::memory_order_relaxed); }
uint64_t Announcer::announcements_skipped() const { return skipped_.load(std::memory_order_relaxed); }

void Announcer::forget_older_than(Clock::time_point before) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(streams_, [&](const auto& s) { return s.second.touched < before; });
}

Announcer::Messages Announcer::take_announcements(RequestId request, Stream& s) {
  Messages out;
  const size_t first = s.announced;
  for (; s.announced < s.saved.size(); ++s.announced) {
    Message ready;
    ready.kind = Message::Kind::kReady;
    ready.request = request;
    ready.layer = s.saved[s.announced].first;
    ready.event = s.saved[s.announced].second;
    const std::string m = format_message(ready);
    std::lock_guard<std::mutex> lock(unread_->mu);
    for (PeerId p : s.readers) {
      if (unread_->peers.count(p) == 0) out.emplace_back(p, m);
    }
  }
  skipped_.fetch_add(s.readers.size() * (s.saved.size() - first) - out.size(), std::memory_order_relaxed);
  sent_.fetch_add(out.size(), std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(s.acks->mu);
  s.acks->outstanding += out.size();
  return out;
}

// Never blocks: the resender calls back once a reader acknowledged, or
// with the last try's error (one that timed out was sent again first). The
// callback holds only what it counts into.
void Announcer::send(const Messages& messages, const std::shared_ptr<Acks>& acks) {
  const auto give_up = Clock::now() + timeout_;
  for (const auto& [peer, m] : messages) {
    resender_.send(
        peer, m, give_up, [failures = failures_, acks, unread = unread_, to = peer](Status s, std::string answer) {
          if (!s.ok()) failures->add(s);
          if (std::optional<Message> a = parse_message(answer); s.ok() && a && a->kind == Message::Kind::kUnread) {
            std::lock_guard<std::mutex> lock(unread->mu);
            if (unread->peers.size() >= kUnreadKept) unread->peers.clear();
            unread->peers.insert(to);
          }
          {
            std::lock_guard<std::mutex> lock(acks->mu);
            if (!s.ok() && acks->first_error.ok()) {
              acks->first_error = Status::unavailable("a layer announcement was not acknowledged: " + s.to_string());
            }
            --acks->outstanding;
          }
          acks->cv.notify_all();
        });
  }
}

}  // namespace kvbridge::connector
