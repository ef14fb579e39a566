#include "connector/announcer.h"

#include <algorithm>

#include "common/text.h"
#include "connector/messages.h"

namespace kvbridge::connector {

using Clock = std::chrono::steady_clock;

void SendFailures::add(const Status& s) {
  std::lock_guard<std::mutex> lock(mu);
  ++failed;
  last_error = s.to_string();
}

Announcer::Announcer(Engine& engine, Remotes& remotes, std::vector<std::string> layers,
                     std::chrono::milliseconds timeout, std::shared_ptr<SendFailures> failures)
    : engine_(engine),
      remotes_(remotes),
      layers_(std::move(layers)),
      timeout_(timeout),
      failures_(std::move(failures)) {}

Status Announcer::stream_to(RequestId request, const std::string& instance) {
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<const Fetched> fetched, remotes_.fetch(instance));
  std::vector<PeerId> readers;
  for (size_t r = 0; r < fetched->infos.size(); ++r) {
    KVB_ASSIGN_OR_RETURN(PeerId p, remotes_.peer(instance, r));
    readers.push_back(p);
  }
  Messages messages;
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Stream& s = streams_[request];
    if (!s.instance.empty() && s.instance != instance) {
      return Status::already_exists("request " + q(request) + " already streams to " + s.instance);
    }
    s.instance = instance;
    s.readers = std::move(readers);
    s.touched = Clock::now();
    messages = take_announcements(request, s);
    acks = s.acks;
  }
  send(messages, acks);
  return Status();
}

Status Announcer::save_layer(RequestId request, std::string_view layer) {
  if (std::find(layers_.begin(), layers_.end(), layer) == layers_.end()) {
    return Status::invalid_argument("no layer " + q(layer) + " in this rank's layout");
  }
  Messages messages;
  std::shared_ptr<Acks> acks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Stream& s = streams_[request];
    s.touched = Clock::now();
    if (std::find(s.saved.begin(), s.saved.end(), layer) != s.saved.end()) return Status();
    s.saved.emplace_back(layer);
    if (!s.instance.empty()) messages = take_announcements(request, s);
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
    if (!acks->cv.wait_for(lock, timeout, [&] { return acks->outstanding == 0; })) {
      return Status::timeout("request " + q(request) + ": " + std::to_string(acks->outstanding) +
                             " layer announcements not acknowledged within " + std::to_string(timeout.count()) + " ms");
    }
    out = acks->first_error;
  }
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(request);
  return out;
}

void Announcer::forget_older_than(Clock::time_point before) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(streams_, [&](const auto& s) { return s.second.touched < before; });
}

Announcer::Messages Announcer::take_announcements(RequestId request, Stream& s) {
  Messages out;
  for (; s.announced < s.saved.size(); ++s.announced) {
    const std::string m = format_message(Message::Kind::kReady, request, s.saved[s.announced]);
    for (PeerId p : s.readers) out.emplace_back(p, m);
  }
  std::lock_guard<std::mutex> lock(s.acks->mu);
  s.acks->outstanding += out.size();
  return out;
}

// Never blocks: the engine calls back when a reader acknowledged, at the
// deadline, or when the reader is gone. The callback holds only what it
// counts into.
void Announcer::send(const Messages& messages, const std::shared_ptr<Acks>& acks) {
  for (const auto& [peer, m] : messages) {
    engine_.notify(peer, m, timeout_, [failures = failures_, acks](Status s) {
      if (!s.ok()) failures->add(s);
      {
        std::lock_guard<std::mutex> lock(acks->mu);
        if (!s.ok() && acks->first_error.ok()) acks->first_error = s;
        --acks->outstanding;
      }
      acks->cv.notify_all();
    });
  }
}

}  // namespace kvbridge::connector
