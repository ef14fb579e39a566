// `kvbridge layout` (a preset's layout as JSON) and `kvbridge presets`.

#include <algorithm>
#include <iostream>
#include <memory>

#include "cli.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/presets.h"

namespace kvbridge::cli {
namespace {

struct LayoutArgs {
  PresetOptions preset;
  std::string order = "LBHNC";
  bool compact = false;
};

int run_layout(const LayoutArgs& args) {
  PresetOptions options = args.preset;
  // The option was checked at parse time.
  options.order = parse_order(args.order).value();
  Result<Layout> layout = make_preset(options);
  if (!layout) return fail(layout.error());
  std::cout << to_json(*layout, args.compact ? -1 : 2) << "\n";
  return 0;
}

int run_presets() {
  size_t width = 0;
  for (const std::string& name : preset_names()) width = std::max(width, name.size());
  for (const std::string& name : preset_names()) {
    std::cout << name << std::string(width - name.size() + 2, ' ') << preset_summary(name) << "\n";
  }
  return 0;
}

}  // namespace

Command add_layout_command(CLI::App& root) {
  auto args = std::make_shared<LayoutArgs>();
  CLI::App* app = root.add_subcommand("layout", "Print the layout (kvbridge.layout JSON) of one rank of a preset");
  app->add_option("--preset", args->preset.name, "Preset name (see `kvbridge presets`)")->required();
  app->add_option("--tp", args->preset.tp_size, "Tensor-parallel size")->capture_default_str();
  app->add_option("--rank", args->preset.tp_rank, "TP rank, below --tp")->capture_default_str();
  app->add_option("--pp", args->preset.pp_size, "Pipeline-parallel size: the model's layers split into stages")
      ->capture_default_str();
  app->add_option("--pp-rank", args->preset.pp_rank, "Pipeline stage of this rank, below --pp")->capture_default_str();
  app->add_option("--dcp", args->preset.dcp_size,
                  "Decode context-parallel size: attention tokens dealt over groups of this many TP ranks")
      ->capture_default_str();
  app->add_option("--dcp-interleave", args->preset.dcp_interleave, "Tokens per chunk dealt to one context shard")
      ->capture_default_str();
  app->add_option("--block-tokens", args->preset.block_tokens, "Tokens per logical block (0 or absent: the preset's)")
      ->check(non_negative());
  app->add_option("--kernel-block-tokens", args->preset.kernel_block_tokens,
                  "Tokens per kernel block; divides --block-tokens (0 or absent: the preset's)")
      ->check(non_negative());
  app->add_option("--order", args->order, "Physical order: LBHNC, LBNHC or BLHNC")
      ->capture_default_str()
      ->check([](const std::string& value) -> std::string {
        Result<Order> order = parse_order(value);
        return order ? std::string() : order.error().message();
      });
  app->add_option("--num-blocks", args->preset.num_blocks, "Blocks per group (0 or absent: the preset's)")
      ->check(non_negative());
  app->add_option("--state-blocks", args->preset.state_blocks,
                  "Slots of the state and scratch tensors no attention group uses, e.g. qwen3-next's (0 or absent: "
                  "--num-blocks)")
      ->check(non_negative());
  app->add_option("--spec-tokens", args->preset.spec_tokens, "Speculative tokens (sizes qwen3-next's ring)")
      ->capture_default_str();
  app->add_flag("--compact", args->compact, "Print the JSON on one line");
  return {app, [args] { return run_layout(*args); }};
}

Command add_presets_command(CLI::App& root) {
  CLI::App* app = root.add_subcommand("presets", "List the presets with a summary of each");
  return {app, [] { return run_presets(); }};
}

}  // namespace kvbridge::cli
