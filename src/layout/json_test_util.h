// The layout JSON tests' shared pieces (json_test.cc, json_reject_test.cc):
// the design example, as text and as the struct it parses into, and a
// parse of the example after an edit that must fail.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"

namespace kvbridge::layout_json_testing {

using OJson = nlohmann::ordered_json;

// The example of DESIGN.md, "The layout model".
inline constexpr const char* kDesignExample = R"({
  "format": "kvbridge.layout/1",
  "model": "llama3-8b", "dtype": "bf16",
  "tp_size": 2, "tp_rank": 1,
  "tensors": [{"name": "kv0", "bytes": 268435456, "memory": "host"}],
  "groups": [{
    "name": "full", "kind": "attention",
    "block_tokens": 16, "tokens_per_state": 1,
    "window_tokens": null, "prefix_cacheable": true, "transfer": true,
    "num_blocks": 1024,
    "layers": [{
      "name": "layers.0",
      "components": [{
        "name": "k", "tensor": "kv0", "offset": 0, "cell_bytes": 256,
        "heads": {"total": 8, "first": 4, "count": 4},
        "axes": [{"axis": "block", "size": 1024, "stride": 32768},
                 {"axis": "head",  "size": 4,    "stride": 4096},
                 {"axis": "position", "size": 16, "stride": 256}]
      }]
    }]
  }]
})";

// One group of each kind: an MLA-like latent in kernel pages of 16 tokens
// (two position axes), a compressed indexer (tokens_per_state 4), a sliding
// window with packed K/V on cuda:0, a Mamba-like state with two components in
// one block row, and a scratch ring that is transferred but never cached.

inline Layout design_layout() {
  Layout l;
  l.model = "llama3-8b";
  l.dtype = "bf16";
  l.tp_size = 2;
  l.tp_rank = 1;
  l.tensors = {{"kv0", 268435456, "host"}};
  Group g;
  g.name = "full";
  g.kind = GroupKind::kAttention;
  g.block_tokens = 16;
  g.num_blocks = 1024;
  Component k;
  k.name = "k";
  k.tensor = "kv0";
  k.cell_bytes = 256;
  k.heads = HeadMap{8, 4, 4};
  k.axes = {{AxisKind::kBlock, 1024, 32768}, {AxisKind::kHead, 4, 4096}, {AxisKind::kPosition, 16, 256}};
  g.layers = {Layer{"layers.0", {k}}};
  l.groups = {g};
  return l;
}

// Parses the design example after `edit`; the result must be an error.
inline Status parse_edited(const std::function<void(OJson&)>& edit) {
  OJson j = OJson::parse(kDesignExample);
  edit(j);
  Result<Layout> r = parse_layout(j.dump());
  EXPECT_FALSE(r.has_value()) << j.dump();
  return r.status();
}

inline OJson& component(OJson& j) { return j["groups"][0]["layers"][0]["components"][0]; }

inline constexpr const char* kK = "groups[0] ('full').layers[0] ('layers.0').components[0] ('k')";

}  // namespace kvbridge::layout_json_testing
