// What the device transports share (device_run.h), on the host fake: the
// ready events a run waits for are opened once per owner and released with
// it, a run keeps what it resolved, and a run waits for its producer.
#include "transport/device_run.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

namespace kvbridge::transport {
namespace {

using namespace std::chrono_literals;

TEST(ReadyEventsTest, OpenedHandlesAreCachedPerOwnerAndReleasedWithIt) {
  device::Device& d = device::fake();
  Result<device::Stream> s = d.create_stream(0);
  Result<device::Event> e = d.create_event(0, true);
  ASSERT_TRUE(s.ok() && e.ok());
  ASSERT_TRUE(d.record(*e, *s).ok());
  Result<std::string> h = d.export_event(*e);
  ASSERT_TRUE(h.ok());
  ReadyEvents ready(d);
  RunControl control;
  control.ready_events = {*h};
  Result<std::vector<std::shared_ptr<void>>> first = ready.resolve(control, 7);
  ASSERT_TRUE(first.ok()) << first.error().to_string();
  Result<std::vector<std::shared_ptr<void>>> again = ready.resolve(control, 7);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*first)[0], (*again)[0]) << "opened once for its owner";
  EXPECT_EQ(ready.cached(), 1u);
  Result<std::vector<std::shared_ptr<void>>> other = ready.resolve(control, 8);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(ready.cached(), 2u);
  std::weak_ptr<void> held = (*first)[0];
  ready.forget(7);
  EXPECT_EQ(ready.cached(), 1u) << "the exited owner's events are gone from the cache";
  EXPECT_FALSE(held.expired()) << "a run that resolved it keeps it until it returns";
  first->clear();
  again->clear();
  EXPECT_TRUE(held.expired()) << "closed once its last run let go";
  d.destroy_event(*e);
  d.destroy_stream(*s);
}

}  // namespace
}  // namespace kvbridge::transport
