// StageTemplate (kvbridge/plan.h): one PlanTemplate per stage of a shape,
// each built by template_build.cc for its stage's cut.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/plan.h"
#include "plan/internal.h"
#include "plan/template.h"

namespace kvbridge {

struct StageTemplate::Impl {
  Layout local;
  std::vector<Layout> remotes;
  RequestShape shape;
  StageOptions options;
  bool uniform = true;
  std::string fallback_reason;
  // The stages that move something, in plan_stages()' order: each one's
  // fields but its plan (those of the probe request), and its template.
  std::vector<PlanStage> headers;
  std::vector<PlanTemplate> templates;
  std::optional<PlanTemplate> whole;  // checks a request when no stage moves anything
};

Result<StageTemplate> StageTemplate::create(const Layout& local, std::span<const Layout> remotes,
                                            const RequestShape& shape, const StageOptions& options) {
  using namespace plan_internal;
  // The whole shape's template first: it checks the shape (plan()'s errors
  // for a request of it) and finds whether every stage can be uniform.
  KVB_ASSIGN_OR_RETURN(PlanTemplate whole, PlanTemplate::create(local, remotes, shape));
  auto t = std::make_shared<Impl>();
  t->local = local;
  t->remotes.assign(remotes.begin(), remotes.end());
  t->shape = shape;
  t->options = options;
  t->whole = whole;
  if (!whole.uniform()) {
    t->uniform = false;
    t->fallback_reason = whole.fallback_reason();
    return StageTemplate(std::move(t));
  }
  // The cuts are the shape's: the probe (blocks 0, 1, 2, ... where the shape
  // lists blocks) cuts as every request of the shape does.
  KVB_ASSIGN_OR_RETURN(Request probe, probe_request(local, remotes, shape));
  KVB_ASSIGN_OR_RETURN(std::vector<GroupMove> moves, group_moves(local, remotes, probe));
  for (const StageCut& cut : stage_cuts(local, remotes, moves, probe, options)) {
    KVB_ASSIGN_OR_RETURN(PlanTemplate stage, build_template(local, remotes, shape, &cut));
    if (!stage.uniform()) {
      t->uniform = false;
      t->fallback_reason = stage.fallback_reason();
      t->headers.clear();
      t->templates.clear();
      break;
    }
    // A stage that holds no piece moves nothing for any request of the
    // shape: plan_stages() leaves it out. (The probe itself may not be a
    // valid request: overlaid groups given the same ids.)
    if (stage.pieces() == 0) continue;
    t->headers.push_back(stage_header(local, remotes, probe, cut));
    t->templates.push_back(std::move(stage));
  }
  return StageTemplate(std::move(t));
}

const RequestShape& StageTemplate::shape() const { return impl_->shape; }
const StageOptions& StageTemplate::options() const { return impl_->options; }
bool StageTemplate::uniform() const { return impl_->uniform; }
const std::string& StageTemplate::fallback_reason() const { return impl_->fallback_reason; }
size_t StageTemplate::stages() const { return impl_->uniform ? std::max<size_t>(impl_->headers.size(), 1) : 0; }

Result<std::vector<PlanStage>> StageTemplate::instantiate(const Request& request) const {
  const Impl& t = *impl_;
  auto planned = [&] { return plan_stages(t.local, t.remotes, request, t.options); };
  if (!t.uniform) return planned();
  std::vector<PlanStage> out;
  out.reserve(t.headers.size());
  for (size_t i = 0; i < t.templates.size(); ++i) {
    PlanStage s = t.headers[i];
    // A request off the shape, or one plan_stages() refuses: its error, as
    // plan_stages() words it.
    if (!t.templates[i].instantiate(request, &s.plan).ok()) return planned();
    out.push_back(std::move(s));
  }
  if (out.empty()) {
    // Moving nothing: plan_stages()' one empty stage, after the checks a
    // request of the shape must pass.
    if (!t.whole->instantiate(request).ok()) return planned();
    out.push_back(plan_internal::empty_stage(t.local, t.remotes, request));
  }
  return out;
}

}  // namespace kvbridge
