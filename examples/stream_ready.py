#!/usr/bin/python3
"""Layer-wise streaming of GPU KV with the producer's readiness, through kvbridge.connector_v1.

Two processes, a prefill and a decode instance (TP 1 each), with vLLM-shaped caches in device
memory. The prefill's forward pass queues each layer's KV on its stream and calls
save_kv_layer at once, as an engine does; the decode reads each layer as it is announced, and
its copy waits on the device for the event recorded after that layer's kernels. Nothing waits
on the host, and no byte is read before it was written.

  - On a GPU (torch.cuda available): the caches are CUDA tensors, each layer is written by
    torch kernels on the current stream, and save_kv_layer(layer, kv_layer) records the
    layer's interprocess event itself.
  - Without one: the host fake (KVB_DEVICE=fake) stands in for the GPU: device memory that two
    processes share, a stream whose copy lands after a slow kernel (DELAY), and its event,
    which save_kv_layer(layer, ready=event) hands over.

The decode then checks every byte of every layer against what the prefill wrote.
Run: PYTHONPATH=<build>/python /usr/bin/python3 examples/stream_ready.py
"""

import ctypes
import multiprocessing as mp
import os
import sys
import time
import types

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 4, 8, 16, 4, 64
PROMPT = list(range(48))              # 48 tokens: 3 prefill blocks, 2 decode blocks of 32
PREFILL_BLOCKS, DECODE_BLOCKS = [1, 2, 3], [4, 5]
DELAY = 0.05                          # the fake's slow kernel before each layer lands (seconds)


def use_gpu():
    import torch
    return torch.cuda.is_available() and os.environ.get("KVB_DEVICE") != "fake"


class FakeCuda:
    """A torch tensor over the host fake's device memory that says it is on cuda:0."""

    def __init__(self, t):
        self._t = t

    @property
    def device(self):
        return types.SimpleNamespace(type="cuda", index=0)

    def __getitem__(self, i):
        return FakeCuda(self._t[i])

    def __getattr__(self, name):
        return getattr(self._t, name)


def caches(block_size):
    """{layer: [2, blocks, block_size, heads, head_size] bf16} in device memory, and for the fake,
    the host view of each (the fake's device memory is mapped in this process)."""
    import torch
    import kvbridge
    shape = (2, BLOCKS, block_size, HEADS, HEAD_SIZE)
    if use_gpu():
        kv = {f"layers.{i}": torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for i in range(LAYERS)}
        return kv, kv
    kv, host = {}, {}
    for i in range(LAYERS):
        n = 2 * BLOCKS * block_size * HEADS * HEAD_SIZE * 2
        ptr = kvbridge.testing.device_allocate(0, n)
        t = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
        t.zero_()
        host[f"layers.{i}"] = t.view(torch.bfloat16).view(*shape)
        kv[f"layers.{i}"] = FakeCuda(host[f"layers.{i}"])
    return kv, host


def expected(layer, block, kv_index):
    """What the prefill writes: a value per (layer, block, K or V) of the prompt's blocks."""
    return float(1 + layer * 16 + block * 2 + kv_index)


def prefill(conn):
    import torch
    import kvbridge
    from kvbridge import connector_v1 as c1
    config = c1.ConnectorConfig(instance_id="prefill", role="prefill", model="toy", num_kv_heads=HEADS)
    kv, host = caches(16)
    worker = c1.WorkerConnector(config, 0)
    layout = worker.register_kv_caches(kv)
    scheduler = c1.SchedulerConnector(config, layout=layout)
    scheduler.set_xfer_handshake_metadata([worker.get_handshake_metadata()])
    conn.send(worker.get_handshake_metadata())
    decode_ranks = conn.recv()
    # The request arrives, handed over to the decode instance, which streams it in.
    params = {"do_remote_decode": True, "stream_to": {"instance": "decode", "addresses": decode_ranks}}
    scheduler.get_num_new_matched_tokens("req-1", PROMPT, 0, params)
    scheduler.update_state_after_alloc("req-1", PREFILL_BLOCKS, 0)
    conn.send(scheduler.transfer_params("req-1"))  # the router forwards it at once
    conn.recv()  # the decode admitted it
    worker.bind_connector_metadata(scheduler.build_connector_meta())
    worker.start_load_kv()
    # The forward pass: each layer's KV is queued on the device, and the hook runs at once.
    keep = []
    for i, layer in enumerate(kvbridge.layer_order(layout)):
        if use_gpu():
            t = kv[layer]
            for b in PREFILL_BLOCKS:  # kernels on the current stream, not finished when the hook runs
                t[0, b].fill_(expected(i, b, 0))
                t[1, b].fill_(expected(i, b, 1))
            worker.save_kv_layer(layer, t)  # records the layer's interprocess event on that stream
        else:
            staging = host[layer].clone()
            for b in PREFILL_BLOCKS:
                staging[0, b].fill_(expected(i, b, 0))
                staging[1, b].fill_(expected(i, b, 1))
            block_bytes = staging[0, 0].numel() * 2
            base = host[layer].data_ptr()
            copies = [(base + (k * BLOCKS + b) * block_bytes, staging.data_ptr() + (k * BLOCKS + b) * block_bytes,
                       block_bytes) for k in range(2) for b in PREFILL_BLOCKS]
            event = kvbridge.testing.device_copy_later(0, copies, DELAY)  # lands DELAY later
            worker.save_kv_layer(layer, ready=event)
            keep.append(staging)  # alive until its copy ran
        print(f"prefill: {layer} queued and announced", flush=True)
    worker.wait_for_save()
    if not use_gpu():
        kvbridge.testing.device_drain(0)
    scheduler.update_connector_output([worker.build_connector_worker_meta()])
    scheduler.request_finished("req-1", PREFILL_BLOCKS)
    deadline = time.monotonic() + 30
    while "req-1" not in scheduler.take_finished().finished_sending:
        assert time.monotonic() < deadline, "the decode never said done"
        worker.bind_connector_metadata(scheduler.build_connector_meta())
        worker.start_load_kv()
        scheduler.update_connector_output([worker.build_connector_worker_meta()])
        time.sleep(0.01)
    print("prefill: blocks released (read)", flush=True)
    conn.send("done")
    worker.close()


def decode(conn):
    import kvbridge
    from kvbridge import connector_v1 as c1
    config = c1.ConnectorConfig(instance_id="decode", role="decode", model="toy", num_kv_heads=HEADS, stream=True)
    kv, host = caches(32)
    worker = c1.WorkerConnector(config, 0)
    layout = worker.register_kv_caches(kv)
    scheduler = c1.SchedulerConnector(config, layout=layout)
    conn.send([worker.get_handshake_metadata()])
    params = conn.recv()
    assert scheduler.get_num_new_matched_tokens("req-1", PROMPT, 0, params) == (len(PROMPT), True)
    scheduler.update_state_after_alloc("req-1", DECODE_BLOCKS, len(PROMPT))
    meta = scheduler.build_connector_meta()
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()  # reads each layer once it is announced, after its event
    conn.send("admitted")
    deadline = time.monotonic() + 30
    outcome = None
    while outcome is None:
        assert time.monotonic() < deadline, "the load did not end"
        scheduler.update_connector_output([worker.build_connector_worker_meta()])
        outcome = scheduler.take_finished().outcomes.get("req-1")
        time.sleep(0.005)
    assert outcome.outcome == "finished", outcome.error
    # Every byte: prefill token t is at prefill block 1 + t // 16, decode block 4 + t // 32.
    wrong = 0
    for i, layer in enumerate(kvbridge.layer_order(layout)):
        t = host[layer].float().cpu() if use_gpu() else host[layer].float()
        for tok in range(len(PROMPT)):
            pb, db, off = PREFILL_BLOCKS[tok // 16], DECODE_BLOCKS[tok // 32], tok % 32
            for k in range(2):
                wrong += int((t[k, db, off] != expected(i, pb, k)).sum())
    print(f"decode: request req-1 finished; {LAYERS} layers x {len(PROMPT)} tokens compared: "
          f"{'OK' if wrong == 0 else f'{wrong} wrong values'}", flush=True)
    conn.send(wrong)
    worker.close()


def main():
    if not use_gpu():
        os.environ["KVB_DEVICE"] = "fake"  # chosen once per process: before the children import kvbridge
    ctx = mp.get_context("spawn")
    p_end, p_child = ctx.Pipe()
    d_end, d_child = ctx.Pipe()
    procs = [ctx.Process(target=prefill, args=(p_child,)), ctx.Process(target=decode, args=(d_child,))]
    for proc in procs:
        proc.start()
    try:
        p_end.recv()                 # the prefill's handshake metadata (not needed by this router)
        p_end.send(d_end.recv())     # the decode's ranks, for stream_to
        d_end.send(p_end.recv())     # the prefill's early params, to the decode
        p_end.send(d_end.recv())     # the decode admitted it
        assert p_end.recv() == "done"
        wrong = d_end.recv()
    finally:
        for proc in procs:
            proc.join(timeout=30)
    ok = wrong == 0 and all(proc.exitcode == 0 for proc in procs)
    print("parent: streamed with readiness:", "OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
