"""Device memory from Python, on the host fake.

Each test runs its body in a fresh /usr/bin/python3 with KVB_DEVICE=fake (the
device is chosen once per process), where "CUDA tensors" are torch tensors
over the fake's device memory that report device cuda:0: the same objects,
for kvbridge, as torch CUDA tensors on a GPU (data_ptr, element_size, numel,
is_contiguous, stride, device). The plain process says why it has no device.
"""
import os
import subprocess
import sys
import textwrap

import kvbridge

# The child's view of the fake's device memory: fake_cuda.py (FakeCuda, cuda_empty), loaded
# without importing torch here.
PRELUDE = f"import sys\nsys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n" + textwrap.dedent('''
    import ctypes, types
    import numpy as np
    import torch
    import kvbridge
    from kvbridge import testing
    from fake_cuda import FakeCuda, cuda_empty

    assert testing.device_name() == "fake", testing.device_name()
''')


def run_fake(body, fake=True):
    env = dict(os.environ)
    if fake:
        env["KVB_DEVICE"] = "fake"
    else:
        env.pop("KVB_DEVICE", None)
    script = PRELUDE + textwrap.dedent(body) if fake else textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def test_without_a_device_cuda_devices_says_why():
    out = run_fake('''
        import kvbridge
        try:
            kvbridge.cuda_devices()
            print("devices")
        except kvbridge.Unavailable as e:
            print("unavailable:", e)
        print("has_cuda", kvbridge.has_cuda)
    ''', fake=False)
    assert "unavailable:" in out or "devices" in out
    if "unavailable:" in out:
        assert "CUDA" in out or "cuda" in out, out
    assert f"has_cuda {kvbridge.has_cuda}" in out


def test_cuda_tensors_register_and_describe_as_cuda_memory():
    run_fake('''
        assert kvbridge.cuda_devices() == 2
        kv, ptr = cuda_empty((2, 8, 16, 4, 32))
        assert kvbridge.describe_tensor(kv)["memory"] == "cuda:0"
        layout = kvbridge.layout_from_tensors({
            "model": "toy", "tensors": {"kv.0": kv}, "dims": "block position head cell",
            "groups": {"full": {"layers": {"layers.0": {"k": kv[0], "v": kv[1]}}}}})
        assert layout.tensors[0].memory == "cuda:0", layout.tensors[0].memory
        e = kvbridge.Engine(transports=["local"])
        region = e.register_memory(kv)
        # Host memory registered as device memory is refused, naming what it is.
        try:
            e.register_memory(np.zeros(4096, dtype=np.uint8), memory="cuda:0")
            raise SystemExit("host memory registered as cuda:0")
        except kvbridge.InvalidArgument as err:
            assert "host memory, not cuda:0" in str(err), err
        e.deregister_memory(region)
    ''')


def test_host_and_device_memory_move_both_ways_after_the_producers_event():
    run_fake('''
        a = kvbridge.Engine(name="a", transports=["local"])
        b = kvbridge.Engine(name="b", transports=["local"])
        dev, ptr = cuda_empty((1 << 20,), dtype=torch.uint8, index=1)
        host = np.zeros(1 << 20, dtype=np.uint8)
        rd = b.register_memory(dev)
        rh = a.register_memory(host)
        peer = a.connect(b.metadata())
        # A slow producer fills the device memory; the read waits for its event.
        handle = testing.device_fill_later(1, ptr, 1 << 20, 0x5A, 0.2)
        t = a.submit(peer, "read", [kvbridge.TransferItem(rh, 0, rd, 0, 1 << 20)], ready=handle)
        st = a.wait(t, timeout=10)
        assert st.state == kvbridge.TransferState.DONE, st
        assert (host == 0x5A).all(), "a stale byte arrived before the producer's event"
        # Host -> device.
        host[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        t = a.submit(peer, "write", [kvbridge.TransferItem(rh, 0, rd, 0, 1 << 20)])
        assert a.wait(t, timeout=10).state == kvbridge.TransferState.DONE
        assert testing.device_read(ptr, 1 << 20) == host.tobytes()
        # ready on host memory alone is refused.
        other = np.zeros(4096, dtype=np.uint8)
        ro = b.register_memory(other)
        peer = a.connect(b.metadata())
        try:
            a.submit(peer, "read", [kvbridge.TransferItem(rh, 0, ro, 0, 4096)], ready=handle)
            raise SystemExit("ready on host memory was accepted")
        except kvbridge.InvalidArgument as err:
            assert "host memory only" in str(err), err
    ''')


def test_a_torch_event_never_recorded_is_refused_and_asked_once_whether_it_is_interprocess():
    run_fake('''
        a = kvbridge.Engine(name="a", transports=["local"], device_copy="auto", device_copy_kernel_below=4096,
                            device_copy_kernel_min=1, pin_host_memory=False)
        b = kvbridge.Engine(name="b", transports=["local"])
        dev, ptr = cuda_empty((4096,), dtype=torch.uint8, index=1)
        host = np.zeros(4096, dtype=np.uint8)
        rd = b.register_memory(dev)
        rh = a.register_memory(host)
        peer = a.connect(b.metadata())
        items = [kvbridge.TransferItem(rh, 0, rd, 0, 4096)]

        class TorchLikeEvent:
            # What kvbridge reads of a torch.cuda.Event: cuda_event (0 until
            # its first record) and ipc_handle().
            def __init__(self, raw, handle):
                self.cuda_event, self.handle, self.asked = raw, handle, 0
            def ipc_handle(self):
                self.asked += 1
                if self.handle is None:
                    raise RuntimeError("not an interprocess event")
                return self.handle

        try:
            a.submit(peer, "read", items, ready=TorchLikeEvent(0, None))
            raise SystemExit("an event never recorded was accepted")
        except kvbridge.InvalidArgument as err:
            assert "never recorded" in str(err), err
        handle = testing.device_fill_later(1, ptr, 4096, 0x33, 0.05)
        event = TorchLikeEvent(12345, handle)
        for _ in range(3):
            t = a.submit(peer, "read", items, ready=event)
            assert a.wait(t, timeout=10).state == kvbridge.TransferState.DONE
        assert event.asked == 1, event.asked
        assert (host == 0x33).all()
    ''')


CACHES = '''
LAYERS, NUM_BLOCKS, BLOCK, HEADS, HEAD = 2, 8, 16, 4, 32
def caches(seed=None):
    kv = []
    for i in range(LAYERS):
        t, ptr = cuda_empty((2, NUM_BLOCKS, BLOCK, HEADS, HEAD))
        if seed is not None:
            g = torch.Generator().manual_seed(seed + i)
            t._t.copy_(torch.randn(t._t.shape, generator=g).to(torch.bfloat16))
        kv.append(t)
    layout = kvbridge.layout_from_tensors({
        "model": "toy", "tensors": {f"kv.{i}": t for i, t in enumerate(kv)}, "dims": "block position head cell",
        "groups": {"full": {"layers": {f"layers.{i}": {"k": t[0], "v": t[1]} for i, t in enumerate(kv)}}}})
    assert all(t.memory == "cuda:0" for t in layout.tensors)
    return kv, layout
'''


def test_a_pd_load_of_cuda_tensors_between_two_processes_is_byte_exact():
    """Prefill and decode ConnectorWorkers over "CUDA" caches in two processes: the decode rank pulls
    40 tokens over cuda_ipc into other block ids, byte-exact, and the prefill frees after its done."""
    prefill = PRELUDE + CACHES + textwrap.dedent('''
        import sys, time
        kv, layout = caches(seed=7)
        with kvbridge.Engine(name="prefill/r0") as e, kvbridge.ConnectorWorker(e, layout, kv, instance_id="prefill") as w:
            assert [t.name for t in e.transports() if t.available][:2] == ["local", "cuda_ipc"], e.transports()
            s = kvbridge.PrefillScheduler(lease=20.0)
            s.hold("req-1", {"decode/r0"})
            print(w.side_channel_address, flush=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for ev in w.take_reader_events():
                    s.on_reader_event(ev)
                for r in s.take_releases():
                    print("released", r.reason, flush=True)
                    sys.exit(0)
                time.sleep(0.005)
            sys.exit("no release")
    ''')
    decode = PRELUDE + CACHES + textwrap.dedent('''
        import sys
        kv, layout = caches()
        want, _ = caches(seed=7)
        with kvbridge.Engine(name="decode/r0") as e, kvbridge.ConnectorWorker(e, layout, kv, instance_id="decode") as w:
            w.add_remote("prefill", [sys.argv[1]])
            w.start_load("req-1", "prefill", kvbridge.Request(40, {"full": ([5, 6, 7], [1, 2, 3])}))
            r = w.collect("req-1", timeout=30.0)["req-1"]
            assert r.error.ok, r.error
            for got, exp in zip(kv, want):
                g = got._t[:, [5, 6, 7]].flatten(1, 2)[:, :40].view(torch.int16)
                x = exp._t[:, [1, 2, 3]].flatten(1, 2)[:, :40].view(torch.int16)
                assert torch.equal(g, x), "a loaded value differs"
                got._t[:, [5, 6, 7]] = 0
                assert int(got._t.view(torch.int16).count_nonzero()) == 0, "a byte outside the request was written"
        print("decode ok", r.bytes, flush=True)
    ''')
    env = dict(os.environ, KVB_DEVICE="fake")
    p = subprocess.Popen([sys.executable, "-c", prefill], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        address = p.stdout.readline().strip()
        assert address, p.stderr.read()
        d = subprocess.run([sys.executable, "-c", decode, address], env=env, capture_output=True, text=True,
                           timeout=120)
        assert d.returncode == 0 and "decode ok" in d.stdout, d.stdout + d.stderr
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and "released read" in out, out + err
    finally:
        p.kill()
