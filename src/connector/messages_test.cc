#include "connector/messages.h"

#include <gtest/gtest.h>

namespace kvbridge::connector {
namespace {

TEST(MessagesTest, EachKindRoundTripsAndAnythingElseIsRefused) {
  EXPECT_EQ(format_message(Message::Kind::kHeartbeat, 7), "kvb/1 hb 7");
  EXPECT_EQ(format_message(Message::Kind::kDone, 8), "kvb/1 done 8");
  EXPECT_EQ(format_message(Message::Kind::kReady, 9, "layers.3"), "kvb/1 ready 9 layers.3");
  for (Message::Kind k : {Message::Kind::kHeartbeat, Message::Kind::kDone, Message::Kind::kReady}) {
    const std::string text = format_message(k, 12345, "layers.0");
    std::optional<Message> m = parse_message(text);
    ASSERT_TRUE(m) << text;
    EXPECT_EQ(m->kind, k);
    EXPECT_EQ(m->request, 12345u);
    EXPECT_EQ(m->layer, k == Message::Kind::kReady ? "layers.0" : "");
  }
  for (std::string_view bad : {"", "kvb/1 ", "kvb/2 hb 1", "kvb/1 hb", "kvb/1 hb x", "kvb/1 hb 1 ", "kvb/1 done 1x",
                               "kvb/1 ready 1", "kvb/1 ready 1 ", "kvb/1 ready 1layers.0", "kvb/1 sing 1", "note"}) {
    EXPECT_FALSE(parse_message(bad)) << bad;
  }
}

}  // namespace
}  // namespace kvbridge::connector
