// The stage templates (StageTemplate, kvbridge/plan.h) of the loads a rank
// plans: one per (remote instance snapshot, request shape, stage options),
// built by the second load of its kind (the first is planned as it comes,
// and only noted: a shape is exact, token counts included, and many are
// seen once) and instantiated from each later load's block ids. A decode rank plans its loads with one; a push-mode
// prefill rank plans what its readers would read with another.
//
// Thread-safety: every method may be called from any thread; a template is
// built outside the lock (two loads of a new kind may both build it; one
// is kept).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvbridge/plan.h"

namespace kvbridge::connector {

class StageCache {
 public:
  struct Stats {
    uint64_t built = 0;           // templates built (the second load of a shape)
    uint64_t instantiated = 0;    // loads planned from a template
    uint64_t fresh = 0;           // loads planned by plan_stages(): a shape's first, or its template cannot serve
    std::string fallback_reason;  // why, for the last template that cannot serve
  };

  // At most `capacity` templates; the least recently used goes first.
  explicit StageCache(size_t capacity = 64) : capacity_(capacity) {}

  // The stages of `request`: plan_stages(local, remotes, request, options).
  // Templates are kept per address of `local` and of `remotes`: each must
  // hold the same layouts at that address as long as its owner lives
  // (`local_owner`, `remotes_owner`: a remote instance's fetched metadata,
  // which a refetch replaces with another object; null for a layout that
  // lives as long as the cache). A cached template keeps both owners alive,
  // so an address is not reused while a template names it.
  Result<std::vector<PlanStage>> stages(const Layout& local, std::shared_ptr<const void> local_owner,
                                        std::span<const Layout> remotes, std::shared_ptr<const void> remotes_owner,
                                        const Request& request, const StageOptions& options);

  // The same stages as compact plans (StageTemplate::instantiate_compact(),
  // or with `moved` instantiate_moved(); a stage planned afresh is one
  // literal run). With `naive`, also naive_descriptor_count() of the
  // request, counted once per shape. With `from_first`, a shape's template
  // is built by its first load (a push: the writer and the reader each
  // plan it, and give its stages in the same form only when both took them
  // from a template, or neither could).
  Result<std::vector<CompactStage>> compact_stages(const Layout& local, std::shared_ptr<const void> local_owner,
                                                   std::span<const Layout> remotes,
                                                   std::shared_ptr<const void> remotes_owner, const Request& request,
                                                   const StageOptions& options, uint64_t* naive = nullptr,
                                                   bool moved = false, bool from_first = false);

  Stats stats() const;

 private:
  // The template of the request's kind, built by its second load (with
  // `from_first`, its first); none before, or where a template cannot serve
  // (stats() counts a load planned afresh then, and one from a template
  // otherwise).
  std::optional<StageTemplate> find(const std::string& key, const Request& request, const Layout& local,
                                    std::shared_ptr<const void> local_owner, std::span<const Layout> remotes,
                                    std::shared_ptr<const void> remotes_owner, const StageOptions& options,
                                    bool from_first = false);
  struct Entry {
    std::shared_ptr<const void> local_owner, remotes_owner;
    std::optional<StageTemplate> stages;  // none until the shape's second load
    std::optional<uint64_t> naive;        // naive_descriptor_count(), once counted
    std::list<std::string>::iterator age;
  };
  // The key of the request's kind: of its shape (shape_of()), computed
  // from its lists.
  static std::string key(const Layout& local, std::span<const Layout> remotes, const Request& request,
                         const StageOptions& options);

  const size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;
  std::list<std::string> ages_;  // keys, most recently used first
  Stats stats_;
};

}  // namespace kvbridge::connector
