// The scheduler-side roles of connector.h: leases on the prefill instance,
// request tracking and the failure policy on the decode instance.
#include <algorithm>
#include <cstdio>

#include "common/text.h"
#include "kvbridge/connector.h"

namespace kvbridge {

Status check_request_id(std::string_view id) {
  const std::string rule =
      "; ids are 1 to " + std::to_string(kMaxRequestIdBytes) + " bytes of printable ASCII without spaces";
  if (id.empty()) return Status::invalid_argument("request id is empty" + rule);
  if (id.size() > kMaxRequestIdBytes) {
    return Status::invalid_argument("request id " + q(printable(id, 40)) + " is " + std::to_string(id.size()) +
                                    " bytes" + rule);
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    if (c > 0x20 && c < 0x7f) continue;
    char what[32];
    if (c == ' ') {
      std::snprintf(what, sizeof(what), "a space");
    } else {
      std::snprintf(what, sizeof(what), "byte 0x%02x", c);
    }
    return Status::invalid_argument("request id " + q(printable(id, 40)) + " has " + what + " at byte " +
                                    std::to_string(i) + rule);
  }
  return Status();
}

std::string_view release_reason_name(ReleaseReason reason) {
  switch (reason) {
    case ReleaseReason::kRead:
      return "read";
    case ReleaseReason::kLeaseExpired:
      return "lease_expired";
    case ReleaseReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

std::string_view outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::kFinished:
      return "finished";
    case Outcome::kFailed:
      return "failed";
    case Outcome::kRecompute:
      return "recompute";
    case Outcome::kAborted:
      return "aborted";
  }
  return "unknown";
}

Result<FailurePolicy> parse_failure_policy(std::string_view name) {
  if (name == "fail") return FailurePolicy::kFail;
  if (name == "recompute") return FailurePolicy::kRecompute;
  return Status::invalid_argument("unknown failure policy '" + std::string(name) + "' (known: fail, recompute)");
}

Result<TransferMode> parse_transfer_mode(std::string_view name) {
  if (name == "pull") return TransferMode::kPull;
  if (name == "push") return TransferMode::kPush;
  return Status::invalid_argument("unknown transfer mode " + q(name) + " (known: pull, push)");
}

std::string_view transfer_mode_name(TransferMode mode) { return mode == TransferMode::kPush ? "push" : "pull"; }

// --- PrefillScheduler -------------------------------------------------------

Status PrefillScheduler::hold(RequestId request, SteadyTime now) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (held_.count(request) != 0) {
    return Status::already_exists("request " + q(request) + " is already held");
  }
  Held h;
  h.derived = true;
  h.expires = now + lease_;
  held_[request] = std::move(h);
  return Status();
}

Status PrefillScheduler::hold(RequestId request, std::set<std::string> readers, SteadyTime now) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (readers.empty()) return Status::invalid_argument("request " + q(request) + ": no expected reader");
  if (held_.count(request) != 0) {
    return Status::already_exists("request " + q(request) + " is already held");
  }
  Held h;
  h.waiting = std::move(readers);
  h.expires = now + lease_;
  held_[request] = std::move(h);
  return Status();
}

Status PrefillScheduler::hold(RequestId request, uint32_t readers, SteadyTime now) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (readers == 0) return Status::invalid_argument("request " + q(request) + ": no expected reader");
  if (held_.count(request) != 0) {
    return Status::already_exists("request " + q(request) + " is already held");
  }
  Held h;
  h.count = readers;
  h.expires = now + lease_;
  held_[request] = std::move(h);
  return Status();
}

void PrefillScheduler::count_reader(Held& h, const std::string& reader, uint32_t readers) {
  auto [it, first] = h.said.emplace(reader, readers);
  if (!first && readers != 0) it->second = readers;
  // The largest count any reader said: a disagreement holds longer, never
  // shorter (the lease still bounds it), and take_releases() reports it.
  for (const auto& [name, n] : h.said) h.count = std::max(h.count, n);
}

std::string PrefillScheduler::disagreement(const Held& h) const {
  std::set<uint32_t> counts;
  for (const auto& [name, n] : h.said) {
    if (n != 0) counts.insert(n);
  }
  if (counts.size() < 2) return "";
  std::string out = "readers disagree on how many they are:";
  for (const auto& [name, n] : h.said) {
    if (n != 0) out += (out.back() == ':' ? " " : ", ") + q(name) + " says " + std::to_string(n);
  }
  return out;
}

bool PrefillScheduler::settle_if_done(std::map<RequestId, Held>::iterator it, SteadyTime now) {
  Held& h = it->second;
  bool complete = false;
  if (h.derived) {
    complete = h.count > 0 && h.done.size() >= h.count;
    // Aborted: the readers heard from are the ones that may be reading;
    // once each is done and the grace for one on its way passed, free.
    if (!complete && h.aborted) complete = h.done.size() == h.said.size() && now >= h.abort_free_at;
  } else {
    complete = h.waiting.empty() && h.count == 0;
  }
  if (!complete) return false;
  Release r{it->first,
            h.aborted ? ReleaseReason::kAborted : ReleaseReason::kRead,
            {},
            0,
            disagreement(h),
            {h.done.begin(), h.done.end()}};
  if (h.derived && h.count > h.done.size()) r.missing_count = h.count - static_cast<uint32_t>(h.done.size());
  ready_.push_back(std::move(r));
  held_.erase(it);
  return true;
}

void PrefillScheduler::on_event(const ReaderEvent& event, SteadyTime now) {
  auto it = held_.find(event.request);
  if (it == held_.end()) return;
  Held& h = it->second;
  if (h.derived) {
    if (h.done.count(event.reader) != 0) return;  // a repeat, or a heartbeat after done
    count_reader(h, event.reader, event.readers);
    h.heard = true;
    h.expires = std::max(h.expires, now + lease_);
    if (event.kind == ReaderEvent::Kind::kDone) {
      h.done.insert(event.reader);
      settle_if_done(it, now);
    }
    return;
  }
  if (event.kind == ReaderEvent::Kind::kDone) {
    reader_done(event.request, event.reader, now);
  } else {
    heartbeat(event.request, event.reader, now);
  }
}

void PrefillScheduler::heartbeat(RequestId request, const std::string& reader, SteadyTime now) {
  auto it = held_.find(request);
  if (it == held_.end()) return;
  Held& h = it->second;
  if (h.derived) return on_event(ReaderEvent{ReaderEvent::Kind::kHeartbeat, request, reader, 0}, now);
  if (h.count > 0 ? h.done.count(reader) != 0 : h.waiting.count(reader) == 0) return;
  h.heard = true;
  h.expires = std::max(h.expires, now + lease_);
}

void PrefillScheduler::reader_done(RequestId request, const std::string& reader, SteadyTime now) {
  auto it = held_.find(request);
  if (it == held_.end()) return;
  Held& h = it->second;
  if (h.derived) return on_event(ReaderEvent{ReaderEvent::Kind::kDone, request, reader, 0}, now);
  if (h.count > 0) {
    if (!h.done.insert(reader).second) return;
    --h.count;
  } else if (h.waiting.erase(reader) == 0) {
    return;
  } else {
    h.done.insert(reader);
  }
  h.heard = true;
  h.expires = std::max(h.expires, now + lease_);
  settle_if_done(it, now);
}

Status PrefillScheduler::abort(RequestId request, SteadyTime now) {
  auto it = held_.find(request);
  if (it == held_.end()) return Status::not_found("request " + q(request) + " is not held");
  Held& h = it->second;
  h.aborted = true;
  h.abort_free_at = now + abort_grace_;
  // Nobody heard reading: freed after the grace (take_releases), unless a
  // reader shows up meanwhile; then at its done.
  if (!h.heard) h.expires = std::min(h.expires, h.abort_free_at);
  return Status();
}

std::vector<Release> PrefillScheduler::take_releases(SteadyTime now) {
  for (auto it = held_.begin(); it != held_.end();) {
    auto here = it++;
    const Held& h = here->second;
    if (h.aborted && h.derived && h.heard && settle_if_done(here, now)) continue;
    if (h.expires > now) continue;
    Release r{here->first,
              h.aborted ? ReleaseReason::kAborted : ReleaseReason::kLeaseExpired,
              {h.waiting.begin(), h.waiting.end()},
              h.count,
              disagreement(h),
              {h.done.begin(), h.done.end()}};
    if (h.derived) r.missing_count = h.count > h.done.size() ? h.count - static_cast<uint32_t>(h.done.size()) : 0;
    ready_.push_back(std::move(r));
    held_.erase(here);
  }
  std::vector<Release> out;
  out.swap(ready_);
  return out;
}

std::optional<SteadyTime> PrefillScheduler::next_expiry() const {
  std::optional<SteadyTime> next;
  for (const auto& [id, h] : held_) {
    if (!next || h.expires < *next) next = h.expires;
  }
  return next;
}

// --- DecodeScheduler --------------------------------------------------------

Status DecodeScheduler::expect(RequestId request, uint64_t skip_tokens, SteadyTime deadline) {
  KVB_RETURN_IF_ERROR(check_request_id(request));
  if (waiting_.count(request) != 0) {
    return Status::already_exists("request " + q(request) + " is already waiting");
  }
  waiting_[request] = Waiting{skip_tokens, deadline, {}};
  return Status();
}

Status DecodeScheduler::rank_result(uint32_t rank, const LoadResult& result) {
  auto it = waiting_.find(result.request);
  if (it == waiting_.end()) {
    return Status::not_found("request " + q(result.request) + " is not waiting for KV");
  }
  if (rank >= ranks_) {
    return Status::invalid_argument("rank " + std::to_string(rank) + " is past the instance's " +
                                    std::to_string(ranks_) + " ranks");
  }
  if (!it->second.results.emplace(rank, result).second) {
    return Status::invalid_argument("rank " + std::to_string(rank) + " reported request " + q(result.request) +
                                    " twice");
  }
  if (it->second.results.size() == ranks_) {
    settle(it->first, it->second);
    waiting_.erase(it);
  }
  return Status();
}

// Every rank reported: the request ends as the worst of its ranks.
void DecodeScheduler::settle(RequestId id, Waiting& w) {
  RequestOutcome out{id, Outcome::kFinished, Status(), 0};
  bool aborted = false, failed = false;
  uint64_t first_bad = ~uint64_t{0};
  for (const auto& [rank, r] : w.results) {
    aborted = aborted || r.aborted;
    if (!r.error.ok() && !r.aborted) {
      if (!failed) out.error = r.error.with_context("decode rank " + std::to_string(rank));
      failed = true;
      first_bad = std::min(first_bad, r.first_bad_token);
    }
  }
  if (aborted) {
    out.outcome = Outcome::kAborted;
    if (out.error.ok()) out.error = Status::cancelled("request " + q(id) + " was aborted");
  } else if (failed) {
    out.outcome = policy_ == FailurePolicy::kRecompute ? Outcome::kRecompute : Outcome::kFailed;
    out.recompute_from = std::max(first_bad, w.skip);
  }
  ended_.push_back(std::move(out));
}

void DecodeScheduler::rank_lost(uint32_t rank, const Status& why) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->second.results.count(rank) != 0) {
      ++it;
      continue;
    }
    LoadResult lost;
    lost.request = it->first;
    lost.error = why.with_context("decode rank " + std::to_string(rank) + " is gone");
    lost.first_bad_token = it->second.skip;
    it->second.results.emplace(rank, lost);
    if (it->second.results.size() == ranks_) {
      settle(it->first, it->second);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

Status DecodeScheduler::abort(RequestId request) {
  auto it = waiting_.find(request);
  if (it == waiting_.end()) return Status::not_found("request " + q(request) + " is not waiting");
  ended_.push_back(
      RequestOutcome{request, Outcome::kAborted, Status::cancelled("request " + q(request) + " was aborted"), 0});
  waiting_.erase(it);
  return Status();
}

std::vector<RequestOutcome> DecodeScheduler::take_outcomes(SteadyTime now) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    std::string missing;
    for (uint32_t r = 0; r < ranks_; ++r) {
      if (it->second.results.count(r) == 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    RequestOutcome out{it->first, policy_ == FailurePolicy::kRecompute ? Outcome::kRecompute : Outcome::kFailed,
                       Status::timeout("request " + q(it->first) + ": no load result from decode rank(s) " + missing +
                                       " by the deadline"),
                       it->second.skip};
    ended_.push_back(std::move(out));
    it = waiting_.erase(it);
  }
  std::vector<RequestOutcome> out;
  out.swap(ended_);
  return out;
}

}  // namespace kvbridge
