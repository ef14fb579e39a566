// A tcp transport peer for tests/netns_test.sh: one process per network
// namespace, talking through the Transport/Link seam only.
//
//   tcp_netns_peer serve HOST OUTFILE    listen on HOST, hold 64 MiB with a
//                                        known pattern, write "ADDRESS BASE
//                                        BYTES" to OUTFILE, run until killed
//   tcp_netns_peer client HOST ADDRESS BASE BYTES
//                                        read, write and read back; exit 0
//   tcp_netns_peer gone HOST ADDRESS BASE BYTES
//                                        expects the peer to be unreachable:
//                                        exit 0 on an io_error or timeout
//                                        within the deadline
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "testing/pattern.h"
#include "transport/transport.h"

using namespace kvbridge;
using namespace kvbridge::transport;

namespace {

using testing::pattern;

int fail(const std::string& what) {
  std::fprintf(stderr, "tcp_netns_peer: %s\n", what.c_str());
  return 1;
}

Status run(Link& link, TransferOp op, const std::vector<Copy>& copies, std::chrono::seconds timeout) {
  RunControl control;
  control.deadline = Clock::now() + timeout;
  return link.run(op, copies, control);
}

int serve(const std::string& host, const std::string& out_file) {
  auto t = make_tcp_transport(host, 4, "");
  if (!t.ok()) return fail(t.error().to_string());
  const uint64_t bytes = uint64_t{64} << 20;
  std::vector<uint8_t> mem(bytes);
  for (uint64_t i = 0; i < bytes; ++i) mem[i] = pattern(i);
  if (auto key = (*t)->add_segment(Segment{1, mem.data(), bytes, "host", 3}); !key.ok())
    return fail(key.error().to_string());
  {
    std::ofstream out(out_file + ".tmp");
    out << (*t)->address() << " " << reinterpret_cast<uint64_t>(mem.data()) << " " << bytes << "\n";
  }
  std::rename((out_file + ".tmp").c_str(), out_file.c_str());
  for (;;) ::pause();
}

int client(const std::string& host, const std::string& address, uint64_t base, uint64_t bytes, bool expect_gone) {
  auto t = make_tcp_transport(host, 4, "");
  if (!t.ok()) return fail(t.error().to_string());
  PeerInfo peer;
  peer.name = "netns-server";
  peer.address = address;
  peer.segments.push_back({1, base, bytes, ""});
  auto start = Clock::now();
  auto link = (*t)->connect(peer);
  if (expect_gone) {
    Status s =
        link.ok() ? run(**link, TransferOp::kRead, {Copy{nullptr, base, 0, 1}}, std::chrono::seconds(5)) : link.error();
    if (link.ok()) {
      std::vector<uint8_t> buf(4096);
      s = run(**link, TransferOp::kRead, {Copy{buf.data(), base, buf.size(), 1}}, std::chrono::seconds(5));
    }
    double secs = std::chrono::duration<double>(Clock::now() - start).count();
    std::printf("gone: %s after %.2f s\n", s.to_string().c_str(), secs);
    bool named = s.message().find("netns-server") != std::string::npos;
    const bool gone = s.code() == Code::kIoError || s.code() == Code::kTimeout || s.code() == Code::kUnavailable;
    return gone && named && secs < 15 ? 0 : 1;
  }
  if (!link.ok()) return fail(link.error().to_string());
  std::vector<uint8_t> local(bytes, 0);
  // The whole segment in one copy (spread over the streams).
  auto t0 = Clock::now();
  Status s = run(**link, TransferOp::kRead, {Copy{local.data(), base, bytes, 1}}, std::chrono::seconds(30));
  double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!s.ok()) return fail("read: " + s.to_string());
  for (uint64_t i = 0; i < bytes; ++i) {
    if (local[i] != pattern(i)) return fail("read: byte " + std::to_string(i) + " differs");
  }
  std::printf("read %llu bytes in %.3f s\n", static_cast<unsigned long long>(bytes), secs);
  // 10,000 shuffled 2 KiB descriptors, written and read back.
  const uint64_t block = 2048, count = std::min<uint64_t>(10000, bytes / block);
  std::vector<uint64_t> order(count);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(3));
  std::vector<Copy> copies;
  for (uint64_t i = 0; i < count; ++i)
    copies.push_back(Copy{local.data() + i * block, base + order[i] * block, block, 1});
  for (uint64_t i = 0; i < count * block; ++i) local[i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint8_t> sent(local.begin(), local.begin() + count * block);
  s = run(**link, TransferOp::kWrite, copies, std::chrono::seconds(30));
  if (!s.ok()) return fail("write: " + s.to_string());
  std::fill(local.begin(), local.end(), uint8_t{0});
  s = run(**link, TransferOp::kRead, copies, std::chrono::seconds(30));
  if (!s.ok()) return fail("read back: " + s.to_string());
  if (!std::equal(sent.begin(), sent.end(), local.begin())) return fail("read back differs from what was written");
  std::printf("wrote and read back %llu descriptors of %llu bytes\n", static_cast<unsigned long long>(count),
              static_cast<unsigned long long>(block));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 3 && args[0] == "serve") return serve(args[1], args[2]);
  if (args.size() == 5 && (args[0] == "client" || args[0] == "gone"))
    return client(args[1], args[2], std::stoull(args[3]), std::stoull(args[4]), args[0] == "gone");
  return fail("usage: tcp_netns_peer serve HOST OUTFILE | client|gone HOST ADDRESS BASE BYTES");
}
