// connector/messages.h: the worker-to-worker messages, carried as engine
// notifications (connector.h). Formatting and parsing live here once.
//
// Decode -> prefill:
//   "kvb/1 hb <request> <readers>"    a reader's heartbeat (renews the lease)
//   "kvb/1 done <request> <readers>"  the reader is done with the request;
//                                     in pull mode answered "held" or "released"
//   "kvb/1 cancel <request>"          push mode: stop writing it here
//   "kvb/1 unread <request>"          answers "ready" (and "readyev"): this
//                                     rank reads nothing from the sender
//                                     (the sender is not among its
//                                     source_ranks(), which follow from the
//                                     two instances' layouts), so the
//                                     sender need not announce to it again
//   <readers> is how many ranks of the reading instance read the request
//   (each reads its share of every layer, so all of them do): the prefill
//   holds the blocks until that many distinct readers said done, a count
//   that follows from the decode instance's layout and that nobody
//   configures. It may be absent (0) in a message of an older peer.
// Prefill -> decode:
//   "kvb/1 ready <request> <layer>"   pull streaming: the layer is final
//   "kvb/1 readyev <request> <event> <layer>"
//                                     the same, once the producer's event (an
//                                     interprocess event handle, in hex) has
//                                     completed: the reader's copy waits on it
//   "kvb/1 held <request>"            answers "done": the blocks were held
//                                     when it arrived, so the reads before it
//                                     saw the request's bytes
//   "kvb/1 released <request>"        answers "done": they were released (a
//                                     lease expired, an abort): reads of them
//                                     may have seen another request's bytes
//   "kvb/1 wrote <request> <stage> <stages> <where>"
//                                     push: the stage's bytes from this rank
//                                     landed (sent after them); <where> is
//                                     the writes' places (write_places(), 16
//                                     hex digits): a decode rank takes the
//                                     stage only where they are its own plan's
//   "kvb/1 unwritten <request> <stage> <stages>"  push: they will not
//   "kvb/1 cancelled <request>"       push: nothing more of it lands
//
// Pure; thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/engine.h"

namespace kvbridge::connector {

// The largest producer event handle a "readyev" carries (CUDA's is 64 bytes).
inline constexpr size_t kMaxEventHandleBytes = 128;

struct Message {
  enum class Kind : uint8_t {
    kHeartbeat,
    kDone,
    kReady,
    kWrote,
    kUnwritten,
    kCancel,
    kCancelled,
    kHeld,
    kReleased,
    kUnread,
  } kind = Kind::kHeartbeat;
  RequestId request;
  std::string_view layer;          // kReady: a view into the parsed text
  std::string event;               // kReady: the producer's event handle (bytes), or empty
  uint32_t stage = 0, stages = 0;  // kWrote, kUnwritten: stage < stages
  uint32_t readers = 0;            // kHeartbeat, kDone: the reading instance's ranks (0: not said)
  uint64_t where = 0;              // kWrote: write_places() of the stage's writes
};

// Where a stage's writes go, as one value both sides compute. The writer
// names its items' remote side the destination, the reader (who planned the
// same stage as reads) its local side. Two forms, told apart by the lowest
// bit, so that a stage given in one form never matches the other's:
// - items alone (bit 0): over each item's (destination region, offset;
//   source region, offset; bytes), in any order;
// - items and the runs that repeat them (Engine::submit with runs; no
//   prepared tables; bit 1): over each run, in any order of the runs, its
//   range of items (a moved run: the range's offsets and bytes, once, with
//   the run's regions and shifts; a literal run: each item as above). Both
//   sides give a stage in this form where they instantiated one template
//   (the same runs over the same items): O(items + runs) to compute, not
//   O(places), so a later layer's stage moved from the first costs a few
//   hashes, however many blocks it writes.
// Pure.
uint64_t write_places(std::span<const TransferItem> items, bool items_are_reads);
// Prefix sums of the items' offsets, so that write_places() of many runs over
// the same items (the stages moved from one stage) walks them once.
class PlaceSums {
 public:
  PlaceSums(std::span<const TransferItem> items, bool items_are_reads);
  size_t size() const { return sum_.size() - 1; }
  // The sum and the xor of items [a, b)'s hashes; a <= b <= size().
  uint64_t sum(size_t a, size_t b) const { return sum_[b] - sum_[a]; }
  uint64_t xor_of(size_t a, size_t b) const { return xor_[b] ^ xor_[a]; }

 private:
  std::vector<uint64_t> sum_, xor_;  // of items [0, k) (size + 1 entries)
};
// Items alone when `runs` is empty, else items and runs. `sums`: of `items`
// named as `items_are_reads` (built here when null).
uint64_t write_places(std::span<const TransferItem> items, std::span<const ItemRun> runs, bool items_are_reads,
                      const PlaceSums* sums = nullptr);
// Whether `where` is a value of the items-and-runs form.
inline bool places_of_runs(uint64_t where) { return (where & 1) != 0; }
std::string format_message(Message::Kind kind, RequestId request, std::string_view layer = {});
std::string format_message(const Message& message);
// Nullopt for anything else (another protocol's notification, an id that
// check_request_id() refuses, a ready without a layer, an event that is not
// lower-case hex of at most kMaxEventHandleBytes bytes, a number that is
// not decimal without leading zeros, a stage not below its count, readers
// of 0, a wrote without its 16-digit <where>, trailing bytes).
std::optional<Message> parse_message(std::string_view text);

}  // namespace kvbridge::connector
