// kvbridge.plan/1 JSON (docs/formats/plan.md).
#include <nlohmann/json.hpp>

#include "kvbridge/plan.h"

namespace kvbridge {

std::string plan_to_json(const Plan& plan, const Layout& local, std::span<const Layout> remotes, bool items,
                         int verified, int indent) {
  nlohmann::ordered_json j;
  j["format"] = "kvbridge.plan/1";
  j["local_rank"] = local.rank();
  j["descriptors"] = plan.descriptors.size();
  j["bytes"] = plan.bytes;
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  const bool stages = !remotes.empty() && remotes[0].pp_size > 1;
  for (const SourceTotals& s : plan.sources) {
    nlohmann::ordered_json o;
    o["rank"] = s.pp_rank * (remotes.empty() ? 1 : remotes[0].tp_size) + s.tp_rank;
    if (stages) {
      o["pp_rank"] = s.pp_rank;
      o["tp_rank"] = s.tp_rank;
    }
    o["descriptors"] = s.descriptors;
    o["bytes"] = s.bytes;
    sources.push_back(std::move(o));
  }
  j["sources"] = std::move(sources);
  if (verified >= 0) j["verified"] = verified == 1;
  if (items) {
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (const Descriptor& d : plan.descriptors) {
      const Layout& r = remotes[d.source];
      list.push_back(nlohmann::ordered_json::array({r.rank(), local.tensors[d.local_tensor].name, d.local_offset,
                                                    r.tensors[d.remote_tensor].name, d.remote_offset, d.bytes}));
    }
    j["items"] = std::move(list);
  }
  return j.dump(indent);
}

}  // namespace kvbridge
