#include "connector/stage_cache.h"

#include <algorithm>
#include <cstring>

namespace kvbridge::connector {

std::string StageCache::key(const Layout& local, std::span<const Layout> remotes, const Request& request,
                            const StageOptions& options) {
  // The layouts' addresses, the options, the token counts, and per group its
  // name and the shape's flags of both lists (an id that is not -1 lists a
  // block: shape_of()), each list as its length and its bits: what the
  // request's shape is, without building it.
  std::string k;
  auto put = [&k](uint64_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(reinterpret_cast<uintptr_t>(&local));
  put(reinterpret_cast<uintptr_t>(remotes.data()));
  put(remotes.size());
  put(options.layers_per_stage);
  put(options.chunk_tokens);
  put(request.num_tokens);
  put(request.skip_tokens);
  for (const auto& [name, g] : request.blocks) {
    put(name.size());
    k += name;
    for (const std::vector<int64_t>* ids : {&g.local, &g.remote}) {
      put(ids->size());
      // A list without -1 (the usual one) is a tag; another, a tag and
      // its bits.
      const bool all_listed = std::find(ids->begin(), ids->end(), -1) == ids->end();
      put(all_listed ? 0 : 1);
      if (all_listed) continue;
      uint64_t word = 0;
      for (size_t i = 0; i < ids->size(); ++i) {
        word |= uint64_t{(*ids)[i] != -1} << (i % 64);
        if (i % 64 == 63 || i + 1 == ids->size()) {
          put(word);
          word = 0;
        }
      }
    }
  }
  return k;
}

std::optional<StageTemplate> StageCache::find(const std::string& k, const Request& request, const Layout& local,
                                              std::shared_ptr<const void> local_owner, std::span<const Layout> remotes,
                                              std::shared_ptr<const void> remotes_owner, const StageOptions& options,
                                              bool from_first) {
  bool seen = false;
  std::optional<StageTemplate> t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(k); it != entries_.end()) {
      ages_.splice(ages_.begin(), ages_, it->second.age);
      seen = true;
      t = it->second.stages;
    } else {
      if (entries_.size() >= capacity_ && !ages_.empty()) {
        entries_.erase(ages_.back());
        ages_.pop_back();
      }
      ages_.push_front(k);
      entries_.emplace(
          k, Entry{std::move(local_owner), std::move(remotes_owner), std::nullopt, std::nullopt, ages_.begin()});
    }
  }
  auto fresh = [&]() -> std::optional<StageTemplate> {
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.fresh;
    return std::nullopt;
  };
  // The first load of a shape is planned as it comes: a template pays for
  // itself only from the second load of its shape on.
  if (!seen && !from_first) return fresh();
  if (!t) {
    Result<StageTemplate> built = StageTemplate::create(local, remotes, shape_of(request), options);
    // A shape no request can have: plan_stages() words the request's error.
    if (!built.ok()) return fresh();
    t = std::move(*built);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.built;
    if (!t->uniform()) stats_.fallback_reason = t->fallback_reason();
    if (auto it = entries_.find(k); it != entries_.end() && !it->second.stages) it->second.stages = *t;
  }
  if (!t->uniform()) return fresh();
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.instantiated;
  return t;
}

Result<std::vector<PlanStage>> StageCache::stages(const Layout& local, std::shared_ptr<const void> local_owner,
                                                  std::span<const Layout> remotes,
                                                  std::shared_ptr<const void> remotes_owner, const Request& request,
                                                  const StageOptions& options) {
  std::optional<StageTemplate> t = find(key(local, remotes, request, options), request, local, std::move(local_owner),
                                        remotes, std::move(remotes_owner), options);
  if (!t) return plan_stages(local, remotes, request, options);
  return t->instantiate(request);
}

Result<std::vector<CompactStage>> StageCache::compact_stages(const Layout& local,
                                                             std::shared_ptr<const void> local_owner,
                                                             std::span<const Layout> remotes,
                                                             std::shared_ptr<const void> remotes_owner,
                                                             const Request& request, const StageOptions& options,
                                                             uint64_t* naive, bool moved, bool from_first) {
  const std::string k = key(local, remotes, request, options);
  std::optional<StageTemplate> t =
      find(k, request, local, std::move(local_owner), remotes, std::move(remotes_owner), options, from_first);
  if (naive != nullptr) {
    // A function of the shape: counted by its first load.
    std::optional<uint64_t> known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = entries_.find(k); it != entries_.end()) known = it->second.naive;
    }
    if (!known) {
      known = naive_descriptor_count(local, remotes, request);
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = entries_.find(k); it != entries_.end()) it->second.naive = known;
    }
    *naive = *known;
  }
  if (t) return moved ? t->instantiate_moved(request) : t->instantiate_compact(request);
  KVB_ASSIGN_OR_RETURN(std::vector<PlanStage> stages, plan_stages(local, remotes, request, options));
  std::vector<CompactStage> out;
  out.reserve(stages.size());
  for (PlanStage& st : stages) out.push_back(compact(std::move(st)));
  return out;
}

StageCache::Stats StageCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace kvbridge::connector
