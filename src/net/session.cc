// Session keys and frame tags (see session.h). HMAC-SHA256 through OpenSSL 3's
// EVP_MAC interface (the HMAC_CTX functions are deprecated in OpenSSL 3).
#include "net/session.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdio>
#include <cstdlib>

#include "common/random.h"
#include "net/frame.h"

namespace kvbridge::net {
namespace {

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "kvbridge: OpenSSL %s failed\n", what);
  std::abort();
}

EVP_MAC* hmac_algorithm() {
  static EVP_MAC* mac = [] {
    EVP_MAC* m = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (m == nullptr) die("EVP_MAC_fetch(HMAC)");
    return m;
  }();
  return mac;
}

// A context keyed once, duplicated per frame (cheaper than keying again).
EVP_MAC_CTX* keyed_context(std::string_view key) {
  EVP_MAC_CTX* ctx = EVP_MAC_CTX_new(hmac_algorithm());
  if (ctx == nullptr) die("EVP_MAC_CTX_new");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params) != 1) {
    die("EVP_MAC_init");
  }
  return ctx;
}

std::string seq_bytes(char direction, uint64_t seq) {
  std::string s(1, direction);
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((seq >> (8 * i)) & 0xff));
  return s;
}

}  // namespace

Nonce random_nonce() {
  Nonce n{};
  random_bytes(n.data(), n.size());
  return n;
}

std::string_view view(const Mac& m) { return {reinterpret_cast<const char*>(m.data()), m.size()}; }

Mac hmac(std::string_view key, std::initializer_list<std::string_view> parts) {
  EVP_MAC_CTX* ctx = keyed_context(key);
  for (std::string_view p : parts) {
    if (EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(p.data()), p.size()) != 1) die("EVP_MAC_update");
  }
  Mac out{};
  size_t len = 0;
  if (EVP_MAC_final(ctx, out.data(), &len, out.size()) != 1 || len != out.size()) die("EVP_MAC_final");
  EVP_MAC_CTX_free(ctx);
  return out;
}

bool equal_constant_time(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

struct Session::Keys {
  EVP_MAC_CTX* send = nullptr;
  EVP_MAC_CTX* recv = nullptr;
  char send_direction = 'c';
  char recv_direction = 's';
  ~Keys() {
    EVP_MAC_CTX_free(send);
    EVP_MAC_CTX_free(recv);
  }
  std::array<uint8_t, 16> compute(EVP_MAC_CTX* keyed, char direction, uint64_t seq, std::string_view header,
                                  std::string_view payload) const {
    EVP_MAC_CTX* ctx = EVP_MAC_CTX_dup(keyed);
    if (ctx == nullptr) die("EVP_MAC_CTX_dup");
    const std::string s = seq_bytes(direction, seq);
    for (std::string_view p : {std::string_view(s), header, payload}) {
      if (EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(p.data()), p.size()) != 1) die("EVP_MAC_update");
    }
    Mac full{};
    size_t len = 0;
    if (EVP_MAC_final(ctx, full.data(), &len, full.size()) != 1) die("EVP_MAC_final");
    EVP_MAC_CTX_free(ctx);
    std::array<uint8_t, 16> tag{};
    std::copy_n(full.begin(), tag.size(), tag.begin());
    return tag;
  }
};

Session::Session() = default;
Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

Session::Session(const Mac& key, bool client) : keyed_(true), keys_(std::make_unique<Keys>()) {
  keys_->send = keyed_context(view(key));
  keys_->recv = keyed_context(view(key));
  keys_->send_direction = client ? 'c' : 's';
  keys_->recv_direction = client ? 's' : 'c';
}

std::array<uint8_t, 16> Session::tag(std::string_view header, std::string_view payload) {
  return keys_->compute(keys_->send, keys_->send_direction, send_seq_++, header, payload);
}

bool Session::check(std::string_view header, std::string_view payload, std::string_view tag) {
  const std::array<uint8_t, 16> want = keys_->compute(keys_->recv, keys_->recv_direction, recv_seq_++, header, payload);
  return equal_constant_time(std::string_view(reinterpret_cast<const char*>(want.data()), want.size()), tag);
}

void append_frame(std::string& out, const FrameHeader& header, std::string_view payload, Session& session) {
  FrameHeader h = header;
  h.tagged = session.keyed();
  h.payload_bytes = static_cast<uint32_t>(payload.size());
  const size_t start = out.size();
  encode_header(h, out);
  out.append(payload);
  if (!h.tagged) return;
  const std::string_view head = std::string_view(out).substr(start, kFrameHeaderBytes);
  const std::array<uint8_t, 16> t = session.tag(head, payload);
  out.append(reinterpret_cast<const char*>(t.data()), t.size());
}

}  // namespace kvbridge::net
