// kvbridge/readiness.h: a producer's word that the bytes it queued on a
// device are final, for the copies kvbridge makes of them (the connector's
// loads and pushes, the prefix store's puts and gets).
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge {

// A producer's word that bytes it queued are final (DESIGN.md, "The
// boundary contracts"). On host memory the caller has written them before
// it calls, and nothing is needed. On device memory the kernels that write
// them may still be queued when the engine's hook runs, so the caller names
// an event recorded on the stream that wrote them, after those kernels; the
// copy that reads them waits for it on the device (the host never spins).
struct Readiness {
  // An interprocess event's IPC handle (cudaIpcEventHandle_t's 64 bytes;
  // torch.cuda.Event(interprocess=True).ipc_handle()): what a reader in
  // another process waits on. At most 128 bytes.
  std::string event_handle;
  // An event of this process (a cudaEvent_t, or the device seam's Event),
  // for copies this process makes (push writes; a pull load's reads wait on
  // the consumer's own pending work). The caller keeps it alive until the
  // copy ran (wait_for_save(), the load's result).
  uintptr_t event = 0;
  // The caller already waited for the work on the host (e.g.
  // cudaStreamSynchronize): nothing to wait on.
  bool host_synchronized = false;
  bool empty() const { return event_handle.empty() && event == 0 && !host_synchronized; }
};

}  // namespace kvbridge
