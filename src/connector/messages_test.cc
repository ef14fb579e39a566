#include "connector/messages.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

namespace kvbridge::connector {
namespace {

TEST(MessagesTest, EachKindRoundTripsAndAnythingElseIsRefused) {
  EXPECT_EQ(format_message(Message::Kind::kHeartbeat, "7"), "kvb/1 hb 7");
  EXPECT_EQ(format_message(Message::Kind::kDone, "req-8"), "kvb/1 done req-8");
  EXPECT_EQ(format_message(Message::Kind::kReady, "cmpl-9f", "layers.3"), "kvb/1 ready cmpl-9f layers.3");
  const std::string longest(kMaxRequestIdBytes, 'r');
  for (const std::string id : {"12345", "req-1", "chatcmpl-7f3a/0:x", longest.c_str()}) {
    for (Message::Kind k : {Message::Kind::kHeartbeat, Message::Kind::kDone, Message::Kind::kReady}) {
      const std::string text = format_message(k, id, "layers.0");
      std::optional<Message> m = parse_message(text);
      ASSERT_TRUE(m) << text;
      EXPECT_EQ(m->kind, k);
      EXPECT_EQ(m->request, id);
      EXPECT_EQ(m->layer, k == Message::Kind::kReady ? "layers.0" : "");
    }
  }
  const std::string too_long = "kvb/1 hb " + std::string(kMaxRequestIdBytes + 1, 'r');
  for (std::string_view bad :
       {"", "kvb/1 ", "kvb/2 hb 1", "kvb/1 hb", "kvb/1 hb 1 ", "kvb/1 done 1 x", "kvb/1 ready 1", "kvb/1 ready 1 ",
        "kvb/1 hb a\x01b", "kvb/1 sing 1", "note", "kvb/1 hb  1", "kvb/1 done 1 0", "kvb/1 done 1 02", "kvb/1 hb 1 2 3",
        "kvb/1 held 1 2", "kvb/1 released"}) {
    EXPECT_FALSE(parse_message(bad)) << bad;
  }
  EXPECT_FALSE(parse_message(too_long));
  EXPECT_FALSE(parse_message(std::string_view("kvb/1 hb a\0b", 12)));
}

// A reader says how many ranks of its instance read the request (the
// prefill's hold counts them), and the prefill answers a done with whether
// the blocks were still held.
TEST(MessagesTest, ReadersCarryTheirCountAndDoneIsAnsweredHeldOrReleased) {
  Message m;
  m.kind = Message::Kind::kDone;
  m.request = "req-1";
  m.readers = 4;
  EXPECT_EQ(format_message(m), "kvb/1 done req-1 4");
  m.kind = Message::Kind::kHeartbeat;
  EXPECT_EQ(format_message(m), "kvb/1 hb req-1 4");
  std::optional<Message> p = parse_message("kvb/1 done req-1 12");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->readers, 12u);
  p = parse_message("kvb/1 hb req-1");
  ASSERT_TRUE(p);
  EXPECT_EQ(p->readers, 0u);  // an older peer's: not said
  EXPECT_EQ(format_message(Message::Kind::kHeld, "req-1"), "kvb/1 held req-1");
  EXPECT_EQ(format_message(Message::Kind::kReleased, "req-1"), "kvb/1 released req-1");
  ASSERT_TRUE(parse_message("kvb/1 held req-1"));
  EXPECT_EQ(parse_message("kvb/1 released req-1")->kind, Message::Kind::kReleased);
  // An announcement to a rank that reads nothing from its sender.
  EXPECT_EQ(format_message(Message::Kind::kUnread, "req-1"), "kvb/1 unread req-1");
  EXPECT_EQ(parse_message("kvb/1 unread req-1")->kind, Message::Kind::kUnread);
  EXPECT_FALSE(parse_message("kvb/1 unread"));
  EXPECT_FALSE(parse_message("kvb/1 unread req-1 2"));
}

// A layer announced with the producer's event carries the event's handle
// in hex; the layer name stays the rest of the text.
TEST(MessagesTest, AnAnnouncementCarriesTheProducersEventHandle) {
  Message m;
  m.kind = Message::Kind::kReady;
  m.request = "req-1";
  m.layer = "model.layers.0 attn";
  m.event = std::string("\x00\x01\xfe\xff", 4);
  const std::string text = format_message(m);
  EXPECT_EQ(text, "kvb/1 readyev req-1 0001feff model.layers.0 attn");
  std::optional<Message> p = parse_message(text);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->kind, Message::Kind::kReady);
  EXPECT_EQ(p->event, m.event);
  EXPECT_EQ(p->layer, "model.layers.0 attn");
  const std::string longest = "kvb/1 readyev r " + std::string(2 * kMaxEventHandleBytes, 'a') + " l";
  EXPECT_TRUE(parse_message(longest));
  const std::string too_long = "kvb/1 readyev r " + std::string(2 * kMaxEventHandleBytes + 2, 'a') + " l";
  const std::vector<std::string> bad = {"kvb/1 readyev r 0001",
                                        "kvb/1 readyev r  l",
                                        "kvb/1 readyev r 001 l",
                                        "kvb/1 readyev r 00AB l",
                                        "kvb/1 readyev r 0x01 l",
                                        "kvb/1 readyev r 0001 ",
                                        too_long};
  for (const std::string& b : bad) {
    EXPECT_FALSE(parse_message(b)) << b;
  }
}

// Push mode's messages: a stage and the stage count travel in decimal, the
// stage below the count, each value with one text; a wrote says where its
// writes went (16 hex digits).
TEST(MessagesTest, PushMessagesCarryAStageBelowItsCount) {
  Message w;
  w.kind = Message::Kind::kWrote;
  w.request = "req-1";
  w.stage = 3;
  w.stages = 32;
  w.where = 0x0123456789abcdefULL;
  EXPECT_EQ(format_message(w), "kvb/1 wrote req-1 3 32 0123456789abcdef");
  w.kind = Message::Kind::kUnwritten;
  EXPECT_EQ(format_message(w), "kvb/1 unwritten req-1 3 32");
  std::optional<Message> m = parse_message("kvb/1 wrote req-1 31 32 00000000000000ff");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->kind, Message::Kind::kWrote);
  EXPECT_EQ(m->stage, 31u);
  EXPECT_EQ(m->stages, 32u);
  EXPECT_EQ(m->where, 0xffu);
  m = parse_message("kvb/1 cancelled req-1");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->kind, Message::Kind::kCancelled);
  m = parse_message("kvb/1 cancel req-1");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->kind, Message::Kind::kCancel);
  EXPECT_EQ(format_message(Message::Kind::kCancel, "r"), "kvb/1 cancel r");
  for (std::string_view bad :
       {"kvb/1 wrote req-1", "kvb/1 wrote req-1 3", "kvb/1 wrote req-1 32 32 0000000000000000",
        "kvb/1 wrote req-1 03 32 0000000000000000", "kvb/1 wrote req-1 -1 32 0000000000000000",
        "kvb/1 wrote req-1 1 4294967296 0000000000000000", "kvb/1 wrote req-1 1 2 3", "kvb/1 wrote req-1 1  2",
        "kvb/1 wrote req-1 1 2", "kvb/1 wrote req-1 1 2 000000000000000", "kvb/1 wrote req-1 1 2 000000000000000G",
        "kvb/1 wrote req-1 1 2 00000000000000000", "kvb/1 wrote req-1 1 2 ABCDEF0123456789",
        "kvb/1 unwritten req-1 x 2", "kvb/1 unwritten req-1 1 2 0000000000000000", "kvb/1 cancel req-1 x",
        "kvb/1 cancelled", "kvb/1 wrote req-1 +1 2 0000000000000000"}) {
    EXPECT_FALSE(parse_message(bad)) << bad;
  }
}

// Where a stage's writes went is one value on both sides: the writer's items
// (remote = the destination) and the reader's plan of the same stage (local
// = the destination), in any order; another block, offset or length is
// another value.
TEST(MessagesTest, WritePlacesAreTheSameForTheWriterAndTheReaderAndNothingElse) {
  std::vector<TransferItem> writes = {{1, 0, 7, 4096, 256}, {1, 256, 7, 8192, 256}, {2, 0, 8, 0, 64}};
  std::vector<TransferItem> reads;
  for (const TransferItem& w : writes) reads.push_back({w.remote, w.remote_offset, w.local, w.local_offset, w.bytes});
  std::swap(reads[0], reads[2]);
  EXPECT_EQ(write_places(writes, false), write_places(reads, true));
  std::vector<TransferItem> elsewhere = writes;
  elsewhere[1].remote_offset += 5 * 4096;  // another block of the decode rank
  EXPECT_NE(write_places(elsewhere, false), write_places(reads, true));
  std::vector<TransferItem> shorter = writes;
  shorter[2].bytes = 32;
  EXPECT_NE(write_places(shorter, false), write_places(reads, true));
  std::vector<TransferItem> doubled = writes;
  doubled.push_back(writes[0]);
  doubled.push_back(writes[0]);
  EXPECT_NE(write_places(doubled, false), write_places(writes, false));
  EXPECT_NE(write_places({}, false), write_places(writes, false));
}

// A stage given as items and the runs that repeat them (a later layer's
// stage moved from the first) hashes each run once: the writer and the
// reader agree when they hold the same runs over the same items, whatever
// the runs' order, and any other place, range, region or shift differs; a
// stage given as items alone never matches the same places as runs.
TEST(MessagesTest, WritePlacesOfRunsAreOneHashPerRunAndTheFormsDiffer) {
  // The reader's side: its items (local first) and runs moving them.
  const std::vector<TransferItem> reads = {
      {1, 0, 7, 4096, 64}, {1, 8192, 7, 0, 64}, {1, 4096, 8, 8192, 64}, {2, 0, 8, 0, 32}};
  const std::vector<ItemRun> runs = {
      {0, 3, false}, {0, 3, true, 3, 1 << 20, 9, 2 << 20}, {1, 2, true, 4, 0, 9, 4096}, {3, 1, true, 5, 64, 10, 0}};
  // The writer's: the same, turned around.
  std::vector<TransferItem> writes;
  for (const TransferItem& r : reads) writes.push_back({r.remote, r.remote_offset, r.local, r.local_offset, r.bytes});
  std::vector<ItemRun> wruns;
  for (const ItemRun& r : runs)
    wruns.push_back({r.first, r.count, r.moved, r.remote, r.remote_shift, r.local, r.local_shift});
  const uint64_t where = write_places(reads, runs, true);
  EXPECT_TRUE(places_of_runs(where));
  EXPECT_EQ(write_places(writes, wruns, false), where);
  std::vector<ItemRun> reordered = wruns;
  std::reverse(reordered.begin(), reordered.end());
  EXPECT_EQ(write_places(writes, reordered, false), where);
  // Sums built once serve every stage over the same items.
  const PlaceSums sums(reads, true);
  EXPECT_EQ(write_places(reads, runs, true, &sums), where);
  EXPECT_EQ(write_places(reads, std::span<const ItemRun>(runs).subspan(1, 1), true, &sums),
            write_places(reads, std::span<const ItemRun>(runs).subspan(1, 1), true));
  // The same places as items alone: the other form.
  std::vector<TransferItem> expanded;
  for (const ItemRun& r : runs) {
    for (uint64_t k = r.first; k < r.first + r.count; ++k) {
      const TransferItem& i = reads[k];
      expanded.push_back(r.moved ? TransferItem{r.local, i.local_offset + r.local_shift, r.remote,
                                                i.remote_offset + r.remote_shift, i.bytes}
                                 : i);
    }
  }
  EXPECT_FALSE(places_of_runs(write_places(expanded, true)));
  EXPECT_NE(write_places(expanded, true), where);
  EXPECT_EQ(write_places(expanded, std::span<const ItemRun>{}, true), write_places(expanded, true));
  // Anything else differs.
  auto changed = [&](auto&& change) {
    std::vector<TransferItem> i = reads;
    std::vector<ItemRun> r = runs;
    change(i, r);
    return write_places(i, r, true);
  };
  using I = std::vector<TransferItem>;
  using R = std::vector<ItemRun>;
  EXPECT_NE(changed([](I&, R& r) { r[1].local_shift += 4096; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[1].remote_shift += 4096; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[2].local = 5; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[2].remote = 10; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[2].first = 0; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[2].count = 1; }), where);
  EXPECT_NE(changed([](I&, R& r) { r[0].moved = true; }), where);
  EXPECT_NE(changed([](I&, R& r) { r.pop_back(); }), where);
  EXPECT_NE(changed([](I&, R& r) { r.push_back(r[1]); }), where);
  EXPECT_NE(changed([](I& i, R&) { i[1].local_offset += 4096; }), where);
  EXPECT_NE(changed([](I& i, R&) { i[3].bytes = 16; }), where);
  // Two items that swap their destinations (blocks shuffled the other way).
  EXPECT_NE(changed([](I& i, R&) { std::swap(i[0].local_offset, i[1].local_offset); }), where);
  // A literal run's regions are its items'.
  EXPECT_NE(changed([](I& i, R&) { i[0].local = 2; }), where);
}

TEST(MessagesTest, RequestIdsArePrintableAsciiWithoutSpacesAndBounded) {
  EXPECT_TRUE(check_request_id("req-1").ok());
  EXPECT_TRUE(check_request_id(std::string(kMaxRequestIdBytes, 'x')).ok());
  EXPECT_EQ(check_request_id("").message(),
            "request id is empty; ids are 1 to 256 bytes of printable ASCII without spaces");
  EXPECT_EQ(check_request_id("a b").message(),
            "request id 'a b' has a space at byte 1; ids are 1 to 256 bytes of printable ASCII without spaces");
  EXPECT_EQ(check_request_id("a\nb").message(),
            "request id 'a\\x0ab' has byte 0x0a at byte 1; ids are 1 to 256 bytes of printable ASCII without spaces");
  EXPECT_EQ(check_request_id(std::string(300, 'x')).code(), Code::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge::connector
