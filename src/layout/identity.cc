// Identity, compatibility hash and the field-by-field compatibility check.
//
// The identity text is line-based with length-prefixed names, so a name can
// hold any byte without making two different identities print the same.
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "kvbridge/layout.h"

namespace kvbridge {
namespace {

void put_name(std::string& out, std::string_view key, std::string_view value) {
  out += key;
  out += ' ';
  out += std::to_string(value.size());
  out += ':';
  out += value;
}

std::string heads_text(const Component& c) {
  return c.heads ? std::to_string(c.heads->total) : std::string("replicated");
}

std::string window_text(const Group& g) {
  return g.window_tokens ? std::to_string(*g.window_tokens) : std::string("none");
}

std::vector<const Group*> groups_by_name(const Layout& l) {
  std::vector<const Group*> gs;
  for (const Group& g : l.groups) gs.push_back(&g);
  std::sort(gs.begin(), gs.end(), [](const Group* a, const Group* b) { return a->name < b->name; });
  return gs;
}

std::string q(std::string_view s) { return "'" + std::string(s) + "'"; }

template <typename T>
Status differs(const std::string& where, std::string_view field, const T& a, const T& b) {
  std::string m = where.empty() ? std::string() : where + ": ";
  m += std::string(field) + " differs: " + a + " vs " + b;
  return Status::incompatible(std::move(m));
}

}  // namespace

std::string identity_text(const Layout& layout) {
  std::string out = "kvbridge.identity/1\n";
  put_name(out, "model", layout.model);
  out += '\n';
  put_name(out, "dtype", layout.dtype);
  out += '\n';
  for (const Group* g : groups_by_name(layout)) {
    put_name(out, "group", g->name);
    out += " kind " + std::string(group_kind_name(g->kind));
    out += " tokens_per_state " + std::to_string(g->tokens_per_state);
    out += " window_tokens " + window_text(*g) + '\n';
    for (const Layer& l : g->layers) {
      put_name(out, " layer", l.name);
      out += '\n';
      for (const Component& c : l.components) {
        put_name(out, "  component", c.name);
        out += " cell_bytes " + std::to_string(c.cell_bytes) + " heads " + heads_text(c) + '\n';
      }
    }
  }
  return out;
}

uint64_t compatibility_hash(const Layout& layout) {
  std::string text = identity_text(layout);
  return XXH3_64bits(text.data(), text.size());
}

std::string compatibility_hash_hex(const Layout& layout) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(compatibility_hash(layout)));
  return buf;
}

Status check_compatible(const Layout& a, const Layout& b) {
  if (a.model != b.model) return differs("", "model", q(a.model), q(b.model));
  if (a.dtype != b.dtype) return differs("", "dtype", q(a.dtype), q(b.dtype));
  std::vector<const Group*> ga = groups_by_name(a), gb = groups_by_name(b);
  for (const Group* g : ga) {
    if (b.find_group(g->name) == nullptr) {
      return Status::incompatible("group " + q(g->name) + " exists on the local side only");
    }
  }
  for (const Group* g : gb) {
    if (a.find_group(g->name) == nullptr) {
      return Status::incompatible("group " + q(g->name) + " exists on the remote side only");
    }
  }
  for (const Group* x : ga) {
    const Group* y = b.find_group(x->name);
    std::string where = "group " + q(x->name);
    if (x->kind != y->kind) {
      return differs(where, "kind", std::string(group_kind_name(x->kind)), std::string(group_kind_name(y->kind)));
    }
    if (x->tokens_per_state != y->tokens_per_state) {
      return differs(where, "tokens_per_state", std::to_string(x->tokens_per_state),
                     std::to_string(y->tokens_per_state));
    }
    if (x->window_tokens != y->window_tokens) {
      return differs(where, "window_tokens", window_text(*x), window_text(*y));
    }
    if (x->layers.size() != y->layers.size()) {
      return differs(where, "layer count", std::to_string(x->layers.size()), std::to_string(y->layers.size()));
    }
    for (size_t i = 0; i < x->layers.size(); ++i) {
      const Layer& lx = x->layers[i];
      const Layer& ly = y->layers[i];
      if (lx.name != ly.name) return differs(where, "layer " + std::to_string(i) + " name", q(lx.name), q(ly.name));
      std::string lwhere = where + " layer " + q(lx.name);
      if (lx.components.size() != ly.components.size()) {
        return differs(lwhere, "component count", std::to_string(lx.components.size()),
                       std::to_string(ly.components.size()));
      }
      for (size_t j = 0; j < lx.components.size(); ++j) {
        const Component& cx = lx.components[j];
        const Component& cy = ly.components[j];
        if (cx.name != cy.name) {
          return differs(lwhere, "component " + std::to_string(j) + " name", q(cx.name), q(cy.name));
        }
        std::string cwhere = lwhere + " component " + q(cx.name);
        if (cx.cell_bytes != cy.cell_bytes) {
          return differs(cwhere, "cell_bytes", std::to_string(cx.cell_bytes), std::to_string(cy.cell_bytes));
        }
        if (heads_text(cx) != heads_text(cy)) return differs(cwhere, "heads.total", heads_text(cx), heads_text(cy));
      }
    }
  }
  return Status();
}

}  // namespace kvbridge
