#include "connector/resend.h"

#include <algorithm>

namespace kvbridge::connector {

Resender::Resender(Engine& engine, std::chrono::milliseconds attempt, std::function<void()> wake)
    : engine_(engine), attempt_(attempt), wake_(std::move(wake)) {}

void Resender::send(PeerId peer, std::string message, Clock::time_point give_up, Done done) {
  try_once(Item{peer, std::move(message), give_up, std::move(done)});
}

void Resender::retry_due() {
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lock(due_->mu);
    items.swap(due_->items);
  }
  for (Item& item : items) try_once(std::move(item));
}

void Resender::try_once(Item item) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(item.give_up - Clock::now());
  const std::chrono::milliseconds timeout = std::clamp(left, std::chrono::milliseconds(1), attempt_);
  const PeerId peer = item.peer;
  std::string message = item.message;
  // Sending again happens on the pump (retry_due), never in the callback: it
  // runs on the engine's threads, which may be ending.
  engine_.ask(peer, std::move(message), timeout,
              [due = due_, wake = wake_, item = std::move(item)](Status s, std::string answer) mutable {
                if (s.code() == Code::kTimeout && Clock::now() < item.give_up) {
                  {
                    std::lock_guard<std::mutex> lock(due->mu);
                    due->items.push_back(std::move(item));
                  }
                  wake();
                  return;
                }
                if (item.done) item.done(std::move(s), std::move(answer));
              });
}

}  // namespace kvbridge::connector
