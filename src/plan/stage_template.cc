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
  std::shared_ptr<const plan_internal::TemplateLayouts> layouts;  // shared with each stage's template
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
  auto t = std::make_shared<Impl>();
  // The cuts are the shape's: the probe (blocks 0, 1, 2, ... where the shape
  // lists blocks) cuts as every request of the shape does. Its errors are
  // plan()'s for the shape, as PlanTemplate::create()'s.
  KVB_ASSIGN_OR_RETURN(StagePrep prep, prepare_stages(local, remotes, shape));
  t->layouts = prep.layouts;
  t->shape = shape;
  t->options = options;
  const Request& probe = prep.probe;
  const std::vector<std::string> order = layer_order(local);
  // The cuts are made once, before any stage narrows prep's moves.
  for (const StageCut& cut : stage_cuts(local, remotes, prep.moves, probe, options, order)) {
    KVB_ASSIGN_OR_RETURN(PlanTemplate stage, build_template(local, remotes, shape, &cut, &prep));
    if (!stage.uniform()) {
      t->uniform = false;
      t->fallback_reason = stage.fallback_reason();
      t->headers.clear();
      t->templates.clear();
      return StageTemplate(std::move(t));
    }
    // A stage that holds no piece moves nothing for any request of the
    // shape: plan_stages() leaves it out. (The probe itself may not be a
    // valid request: overlaid groups given the same ids.)
    if (stage.pieces() == 0) continue;
    t->headers.push_back(stage_header(remotes, probe, cut, order));
    t->templates.push_back(std::move(stage));
  }
  // A shape that moves nothing: the whole shape's template checks a
  // request's ids before plan_stages()' one empty stage is returned.
  if (t->templates.empty()) {
    KVB_ASSIGN_OR_RETURN(PlanTemplate whole, PlanTemplate::create(local, remotes, shape));
    t->whole = std::move(whole);
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
  auto planned = [&] { return plan_stages(t.layouts->local, t.layouts->remotes, request, t.options); };
  if (!t.uniform) return planned();
  if (t.templates.empty()) {
    // Moving nothing: plan_stages()' one empty stage, after the checks a
    // request of the shape must pass.
    if (!t.whole->instantiate(request).ok()) return planned();
    return std::vector<PlanStage>{plan_internal::empty_stage(t.layouts->local, t.layouts->remotes, request)};
  }
  // The request checked once for every stage; one that does not fit, or
  // that plan_stages() refuses, gets plan_stages()' answer, word for word.
  std::vector<Plan> plans(t.templates.size());
  if (!plan_internal::instantiate_all(t.templates, request, plans)) return planned();
  std::vector<PlanStage> out(t.headers);
  for (size_t i = 0; i < out.size(); ++i) out[i].plan = std::move(plans[i]);
  return out;
}

Result<std::vector<CompactStage>> StageTemplate::instantiate_compact(const Request& request) const {
  const Impl& t = *impl_;
  // Where the template falls back, moves nothing or cannot hold a stage
  // compact: instantiate()'s stages, each one literal run.
  auto whole = [&]() -> Result<std::vector<CompactStage>> {
    KVB_ASSIGN_OR_RETURN(std::vector<PlanStage> stages, instantiate(request));
    std::vector<CompactStage> out;
    out.reserve(stages.size());
    for (PlanStage& s : stages) out.push_back(compact(std::move(s)));
    return out;
  };
  if (!t.uniform || t.templates.empty()) return whole();
  std::vector<CompactPlan> plans(t.templates.size());
  if (!plan_internal::instantiate_all_compact(t.templates, request, plans)) return whole();
  std::vector<CompactStage> out(t.headers.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const PlanStage& h = t.headers[i];
    out[i] = {h.first_layer, h.end_layer, h.first_token, h.end_token, h.resume_token, std::move(plans[i])};
  }
  return out;
}

}  // namespace kvbridge
