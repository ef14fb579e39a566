// A rank's memory on a device (RankStoreOptions): the copies of its puts and gets
// move between the device and the store's objects (host memory, not pinned)
// through a pool of pinned host memory, a chunk at a time
// (transport::run_host_staged: one batched device copy per chunk, the
// host's copy of one chunk overlapping the device's copy of the next).
#include <string>

#include "device/device.h"
#include "store/rank_store_impl.h"
#include "transport/device_run.h"
#include "transport/staging.h"

namespace kvbridge {

struct RankStore::Impl::Device {
  std::string memory;  // cuda:N
  int ordinal = 0;
  transport::DeviceRunOptions options;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<transport::StagingPool> pool;
  std::unique_ptr<transport::DeviceSide> side;
  Readiness ready;  // the call's, until its first flush
};

Result<std::shared_ptr<RankStore::Impl::Device>> RankStore::Impl::make_device(const RankStoreOptions& m) {
  if (m.memory == "host") return std::shared_ptr<Device>();
  Result<int> parsed = device::parse_cuda_memory(m.memory);
  if (!parsed.ok()) return parsed.error().with_context("store");
  const int ordinal = *parsed;
  device::Device& dev = device::current();
  Result<int> count = dev.count();
  if (!count.ok()) return Status::unavailable("store: " + m.memory + ": " + count.error().message());
  if (ordinal >= *count) {
    return Status::invalid_argument("store: " + m.memory + ": there is no such device (" + std::to_string(*count) +
                                    " here)");
  }
  const transport::StagingOptions staging{m.staging_bytes, m.staging_chunk_bytes};
  KVB_RETURN_IF_ERROR(transport::check_staging_options(staging).with_context("store"));
  transport::DeviceCopyConfig config;
  config.method = m.device_copy;
  Result<transport::DeviceRunOptions> options = transport::device_run_options(config);
  if (!options.ok()) return options.error().with_context("store: device_copy");
  auto d = std::make_shared<Device>();
  d->memory = m.memory;
  d->ordinal = ordinal;
  d->options = *options;
  d->timeout = m.timeout;
  d->pool = std::make_shared<transport::StagingPool>(dev, staging);
  d->side = std::make_unique<transport::DeviceSide>(dev);
  return d;
}

Status RankStore::Impl::begin(TensorMemory memory, const Readiness& ready) {
  deferred.clear();
  if (!device) {
    if (!ready.event_handle.empty() || ready.event != 0) {
      return Status::invalid_argument("store: a ready event is for device memory; this rank's memory is host memory");
    }
    return Status();
  }
  if (ready.event_handle.size() > 128) {
    return Status::invalid_argument("store: a ready event handle is at most 128 bytes, not " +
                                    std::to_string(ready.event_handle.size()));
  }
  for (size_t t = 0; t < memory.size(); ++t) {
    if (memory[t].empty()) continue;
    KVB_RETURN_IF_ERROR(
        device::check_device_range(device->side->device(), memory[t].data(), memory[t].size(), device->memory)
            .with_context("store: tensor '" + layout.tensors[t].name + "'"));
  }
  device->ready = ready;
  return Status();
}

Status RankStore::Impl::flush(bool to_device) {
  if (!device || deferred.empty()) {
    deferred.clear();
    return Status();
  }
  std::vector<device::DeviceCopy> copies;
  copies.reserve(deferred.size());
  for (const ByteCopy& c : deferred) copies.push_back(device::DeviceCopy{c.dst, c.src, c.bytes});
  deferred.clear();
  transport::RunControl control;
  control.deadline = std::chrono::steady_clock::now() + device->timeout;
  if (!device->ready.host_synchronized) {
    if (!device->ready.event_handle.empty()) control.ready_events.push_back(device->ready.event_handle);
    control.ready_event = device->ready.event;
  }
  device->ready = Readiness();
  return transport::run_host_staged(*device->pool, *device->side, device->ordinal, copies, to_device, device->options,
                                    control,
                                    std::string("store: ") + (to_device ? "get into " : "put from ") + device->memory);
}

}  // namespace kvbridge
