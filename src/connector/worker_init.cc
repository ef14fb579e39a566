// The worker's construction and teardown: init() registers the tensors with
// the engine, makes the side channel, the remotes, the resender, the
// announcer and the pusher, installs the engine's notification hooks and
// starts the pump, start and connect threads; the destructor stops and
// joins them, cancels what is in flight and deregisters the memory.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

#include "common/text.h"
#include "common/thread_name.h"
#include "connector/worker_impl.h"

namespace kvbridge::connector {

WorkerImpl::~WorkerImpl() {
  engine_.set_notification_listener(nullptr);
  engine_.set_notification_answerer(nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  jobs_cv_.notify_all();
  connects_cv_.notify_all();
  poke();
  // A handshake under way ends within the handshake timeout.
  if (starter_.joinable()) starter_.join();
  for (std::thread& t : connectors_) {
    if (t.joinable()) t.join();
  }
  if (pump_.joinable()) pump_.join();
  // No lock held: a transfer's completion callback may run inside cancel().
  for (auto& [id, load] : loads_) {
    for (const LoadTransfer& t : load.transfers) {
      (void)engine_.cancel(t.id);
      (void)engine_.release(t.id);
    }
  }
  server_.reset();
  read_grants_.reset();
  {
    std::lock_guard<std::mutex> lock(mu_);
    release_tables();  // they hold the regions
  }
  for (RegionId r : regions_) (void)engine_.deregister_memory(r);
}

Status WorkerImpl::init(std::span<const std::span<uint8_t>> tensors) {
  KVB_RETURN_IF_ERROR(check_memory(layout_, tensors));
  RankInfo info;
  info.instance_id = options_.instance_id;
  info.rank = layout_.rank();  // pp_rank * tp_size + tp_rank
  info.tp_size = layout_.tp_size * layout_.pp_size;
  info.pid = static_cast<int32_t>(::getpid());
  info.layout_json = to_json(layout_, -1);
  for (size_t t = 0; t < tensors.size(); ++t) {
    KVB_ASSIGN_OR_RETURN(RegionId id, engine_.register_memory(tensors[t].data(), tensors[t].size(),
                                                              layout_.tensors[t].memory, options_.remote_access));
    regions_.push_back(id);
    info.tensors.push_back(
        TensorRegion{layout_.tensors[t].name, id, reinterpret_cast<uint64_t>(tensors[t].data()), tensors[t].size()});
  }
  info.engine_metadata = engine_.metadata();
  incarnation_ = hex16(engine_.instance());
  read_grants_ =
      std::make_unique<ReadGrants>(engine_, layout_, regions_, options_.remote_access == RemoteAccess::kGrantedRead);
  // Which layers a producer writes on a device: their announcements and
  // pushes wait on its events.
  layer_device_.assign(order_.size(), 0);
  for (const Group& g : layout_.groups) {
    for (const Layer& l : g.layers) {
      auto o = ordinal_.find(l.name);
      if (o == ordinal_.end()) continue;
      for (const Component& c : l.components) {
        for (const Tensor& t : layout_.tensors) {
          if (t.name == c.tensor && t.memory != "host") layer_device_[o->second] = 1;
        }
      }
    }
  }
  SideChannelOptions sc;
  sc.host = options_.side_channel_host;
  sc.advertise_host = options_.side_channel_advertise_host;
  sc.secret = options_.secret;
  sc.timeout = options_.handshake_timeout;
  const bool push = options_.mode == TransferMode::kPush;
  const std::string identity = identity_text(layout_) + std::string(push ? kPushIdentityLine : "");
  const uint64_t hash = compatibility_hash(layout_) ^ (push ? kPushHashXor : 0);
  remotes_ = std::make_unique<Remotes>(engine_, layout_, sc, identity, hash);
  // Messages that must arrive (dones, announcements) are sent again when a
  // try's acknowledgement does not come within a couple of heartbeats.
  auto poke_pump = [wake = wake_] {
    {
      std::lock_guard<std::mutex> lock(wake->mu);
      wake->poke = true;
    }
    wake->cv.notify_one();
  };
  resender_ = std::make_unique<Resender>(engine_, std::max(2 * options_.heartbeat_interval, kMinAskTimeout), poke_pump);
  announcer_ = std::make_unique<Announcer>(*remotes_, *resender_, order_, layer_device_, options_.transfer_timeout,
                                           sent_, [this](const std::string& instance) {
                                             std::lock_guard<std::mutex> lock(mu_);
                                             request_connect(instance);
                                           });
  pusher_ = std::make_unique<Pusher>(engine_, *remotes_, stage_cache_, layout_, regions_, order_, layer_device_,
                                     options_, sent_, poke_pump);
  KVB_ASSIGN_OR_RETURN(server_, SideChannelServer::start(sc, identity, hash, std::move(info)));
  // A reader's done is answered with whether the request's blocks were
  // still held when it came (blocks_released()): its reads ended before it
  // was sent, so they saw the request's bytes exactly when the answer is
  // "held". Runs on the engine's control thread; takes only Released's lock.
  // A layer's announcement from a rank this one reads nothing from is
  // answered "unread": the announcer stops announcing to this rank (each
  // prefill rank announces to every decode rank until told). The answerer
  // is removed before the remotes go (~WorkerImpl).
  engine_.set_notification_answerer([released = released_,
                                     remotes = remotes_.get()](const Notification& n) -> std::string {
    std::optional<Message> m = parse_message(n.message);
    if (m && m->kind == Message::Kind::kReady) {
      return remotes->reads_nothing_from({n.peer, n.peer_instance}) ? format_message(Message::Kind::kUnread, m->request)
                                                                    : std::string();
    }
    if (!m || m->kind != Message::Kind::kDone) return {};
    return format_message(released->released_for(m->request, n.peer) ? Message::Kind::kReleased : Message::Kind::kHeld,
                          m->request);
  });
  engine_.set_notification_listener([wake = wake_] {
    {
      std::lock_guard<std::mutex> lock(wake->mu);
      wake->notes = true;
    }
    wake->cv.notify_one();
  });
  pump_ = std::thread([this] {
    set_thread_name("kvb-pump");
    pump();
  });
  starter_ = std::thread([this] {
    set_thread_name("kvb-start");
    // Background work: a caller's wake-up of it must not hand it the
    // caller's CPU (the scheduler would run it first, and start_load()
    // would return only when it sleeps again).
    (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 5);
    start_loop();
  });
  for (int i = 0; i < kConnectThreads; ++i) {
    connectors_.emplace_back([this] {
      set_thread_name("kvb-connect");
      connect_loop();
    });
  }
  return Status();
}

}  // namespace kvbridge::connector
