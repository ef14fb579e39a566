// Identity, compatibility hash and the field-by-field compatibility check.
//
// The identity text is line-based with length-prefixed names, so a name can
// hold any byte without making two different identities print the same.
// compare_identity_text() reads the text back with a strict cursor parser (a
// length prefix, not a newline, ends a name) and then walks the parsed texts in
// the order check_compatible() walks layouts, so both name the same field.
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "common/text.h"
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

namespace {

// Values shown from peer bytes are cut and escaped so that a hostile identity
// cannot flood a log or smuggle control characters into it.
constexpr size_t kShownBytes = 120;

std::string shown(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < kShownBytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f || c == '\\') {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > kShownBytes) out += "...";
  return out;
}

std::string sq(std::string_view s) { return "'" + shown(s) + "'"; }

// An identity text parsed back; every view points into the text.
struct TextComponent {
  std::string_view name, cell_bytes, heads;
};
struct TextLayer {
  std::string_view name;
  std::vector<TextComponent> components;
};
struct TextGroup {
  std::string_view name, kind, tokens_per_state, window_tokens;
  std::vector<TextLayer> layers;
};
struct TextIdentity {
  std::string_view model, dtype;
  std::vector<TextGroup> groups;
};

// A cursor over identity text. Every read checks the bytes left, so any input
// ends in either a parse or a clean failure; each step consumes at least one
// byte, so the parse is linear.
class IdentityReader {
 public:
  explicit IdentityReader(std::string_view text) : text_(text) {}

  bool done() const { return pos_ == text_.size(); }
  bool peek(std::string_view literal) const { return text_.substr(pos_).substr(0, literal.size()) == literal; }
  bool literal(std::string_view lit) {
    if (!peek(lit)) return false;
    pos_ += lit.size();
    return true;
  }
  // "<key> <len>:<bytes>", as put_name() writes it.
  bool name(std::string_view key, std::string_view* out) {
    if (!literal(key) || !literal(" ")) return false;
    uint64_t len = 0;
    size_t digits = 0;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9' && digits < 10) {
      len = len * 10 + static_cast<uint64_t>(text_[pos_] - '0');
      ++pos_;
      ++digits;
    }
    if (digits == 0 || !literal(":") || len > text_.size() - pos_) return false;
    *out = text_.substr(pos_, len);
    pos_ += len;
    return true;
  }
  // " <key> <token>" where the token runs to the next space or newline.
  bool field(std::string_view key, std::string_view* out) {
    if (!literal(" ") || !literal(key) || !literal(" ")) return false;
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] != ' ' && text_[pos_] != '\n') ++pos_;
    *out = text_.substr(start, pos_ - start);
    return !out->empty();
  }

 private:
  std::string_view text_;
  size_t pos_ = 0;
};

bool parse_identity(std::string_view text, TextIdentity* id) {
  IdentityReader r(text);
  if (!r.literal("kvbridge.identity/1\n")) return false;
  if (!r.name("model", &id->model) || !r.literal("\n")) return false;
  if (!r.name("dtype", &id->dtype) || !r.literal("\n")) return false;
  while (!r.done()) {
    TextGroup g;
    if (!r.name("group", &g.name) || !r.field("kind", &g.kind) || !r.field("tokens_per_state", &g.tokens_per_state) ||
        !r.field("window_tokens", &g.window_tokens) || !r.literal("\n"))
      return false;
    while (r.peek(" layer ")) {
      TextLayer l;
      if (!r.name(" layer", &l.name) || !r.literal("\n")) return false;
      while (r.peek("  component ")) {
        TextComponent c;
        if (!r.name("  component", &c.name) || !r.field("cell_bytes", &c.cell_bytes) || !r.field("heads", &c.heads) ||
            !r.literal("\n"))
          return false;
        l.components.push_back(c);
      }
      g.layers.push_back(std::move(l));
    }
    id->groups.push_back(std::move(g));
  }
  return true;
}

Status text_differs(const std::string& where, std::string_view field, std::string_view a, std::string_view b,
                    bool quoted) {
  std::string m = where.empty() ? std::string() : where + ": ";
  m += std::string(field) + " differs: " + (quoted ? sq(a) : shown(a)) + " vs " + (quoted ? sq(b) : shown(b));
  return Status::incompatible(std::move(m));
}

// The first differing field, in check_compatible()'s order; OK if none.
Status compare_parsed(const TextIdentity& a, const TextIdentity& b) {
  if (a.model != b.model) return text_differs("", "model", a.model, b.model, true);
  if (a.dtype != b.dtype) return text_differs("", "dtype", a.dtype, b.dtype, true);
  // The first group of each name counts, as Layout::find_group() finds it.
  std::map<std::string_view, const TextGroup*> ma, mb;
  for (const TextGroup& g : a.groups) ma.emplace(g.name, &g);
  for (const TextGroup& g : b.groups) mb.emplace(g.name, &g);
  for (const TextGroup& g : a.groups) {
    if (!mb.count(g.name)) return Status::incompatible("group " + sq(g.name) + " exists on the local side only");
  }
  for (const TextGroup& g : b.groups) {
    if (!ma.count(g.name)) return Status::incompatible("group " + sq(g.name) + " exists on the remote side only");
  }
  for (const TextGroup& x : a.groups) {
    const TextGroup& y = *mb.at(x.name);
    const std::string where = "group " + sq(x.name);
    if (x.kind != y.kind) return text_differs(where, "kind", x.kind, y.kind, false);
    if (x.tokens_per_state != y.tokens_per_state)
      return text_differs(where, "tokens_per_state", x.tokens_per_state, y.tokens_per_state, false);
    if (x.window_tokens != y.window_tokens)
      return text_differs(where, "window_tokens", x.window_tokens, y.window_tokens, false);
    if (x.layers.size() != y.layers.size())
      return text_differs(where, "layer count", std::to_string(x.layers.size()), std::to_string(y.layers.size()),
                          false);
    for (size_t i = 0; i < x.layers.size(); ++i) {
      const TextLayer& lx = x.layers[i];
      const TextLayer& ly = y.layers[i];
      if (lx.name != ly.name)
        return text_differs(where, "layer " + std::to_string(i) + " name", lx.name, ly.name, true);
      const std::string lwhere = where + " layer " + sq(lx.name);
      if (lx.components.size() != ly.components.size())
        return text_differs(lwhere, "component count", std::to_string(lx.components.size()),
                            std::to_string(ly.components.size()), false);
      for (size_t j = 0; j < lx.components.size(); ++j) {
        const TextComponent& cx = lx.components[j];
        const TextComponent& cy = ly.components[j];
        if (cx.name != cy.name)
          return text_differs(lwhere, "component " + std::to_string(j) + " name", cx.name, cy.name, true);
        const std::string cwhere = lwhere + " component " + sq(cx.name);
        if (cx.cell_bytes != cy.cell_bytes)
          return text_differs(cwhere, "cell_bytes", cx.cell_bytes, cy.cell_bytes, false);
        if (cx.heads != cy.heads) return text_differs(cwhere, "heads.total", cx.heads, cy.heads, false);
      }
    }
  }
  return Status();
}

// The line-by-line fallback for texts that do not parse (or that differ in a
// way the fields do not show, such as a duplicated group).
Status first_differing_line(std::string_view a, std::string_view b) {
  size_t pa = 0, pb = 0;
  for (uint64_t line = 1;; ++line) {
    const size_t ea = std::min(a.find('\n', pa), a.size());
    const size_t eb = std::min(b.find('\n', pb), b.size());
    const bool end_a = pa >= a.size(), end_b = pb >= b.size();
    std::string_view la = end_a ? std::string_view() : a.substr(pa, ea - pa);
    std::string_view lb = end_b ? std::string_view() : b.substr(pb, eb - pb);
    const bool nl_a = ea < a.size(), nl_b = eb < b.size();
    if (end_a != end_b || la != lb || nl_a != nl_b) {
      auto show = [](bool end, std::string_view l, bool nl) {
        if (end) return std::string("(end of text)");
        return sq(l) + (nl ? "" : " (no newline)");
      };
      return Status::incompatible("identity line " + std::to_string(line) + " differs: " + show(end_a, la, nl_a) +
                                  " vs " + show(end_b, lb, nl_b));
    }
    if (end_a) return Status::internal("identity texts differ but no line does");  // unreachable: a == b
    pa = ea + 1;
    pb = eb + 1;
  }
}

}  // namespace

Status compare_identity_text(std::string_view local, std::string_view remote) {
  if (local == remote) return Status();
  TextIdentity a, b;
  if (parse_identity(local, &a) && parse_identity(remote, &b)) {
    Status s = compare_parsed(a, b);
    if (!s.ok()) return s;
  }
  return first_differing_line(local, remote);
}

}  // namespace kvbridge
