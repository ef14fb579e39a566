"""CUDA tensors of a real GPU through the Python module (the device check runs
these there, scripts/gpu-check.sh; python/tests/test_device.py runs the same
paths on the host fake everywhere).

Without a GPU they skip, saying so; with KVB_GPU_REQUIRED=1 (the device
check) a missing GPU fails them instead.
"""
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import kvbridge  # noqa: E402

REQUIRED = os.environ.get("KVB_GPU_REQUIRED") == "1"
HAVE_GPU = torch.cuda.is_available() and os.environ.get("KVB_DEVICE") != "fake"

if not HAVE_GPU:
    if REQUIRED:
        raise RuntimeError("KVB_GPU_REQUIRED=1 but torch sees no CUDA device (or KVB_DEVICE=fake)")
    pytest.skip("no CUDA device for torch here (the device check runs these on a GPU)", allow_module_level=True)


def test_cuda_tensors_move_after_a_recorded_event_and_a_never_recorded_one_is_refused():
    a = kvbridge.Engine(name="a", transports=["local"])
    b = kvbridge.Engine(name="b", transports=["local"])
    n = 64 << 20
    dev = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    host = torch.zeros(n, dtype=torch.uint8).pin_memory()
    rd = b.register_memory(dev)
    rh = a.register_memory(host.numpy())
    peer = a.connect(b.metadata())
    items = [kvbridge.TransferItem(rh, 0, rd, 0, n)]
    never = torch.cuda.Event(interprocess=True)
    with pytest.raises(kvbridge.InvalidArgument, match="never recorded"):
        a.submit(peer, "read", items, ready=never)
    for value in (7, 99, 201):
        # A slow producer: a long kernel chain, then the fill, then the event.
        x = torch.randn(4096, 4096, device="cuda:0")
        for _ in range(20):
            x = x @ x
            x = x / x.norm()
        dev.fill_(value)
        event = torch.cuda.Event(interprocess=True)
        event.record()
        t = a.submit(peer, "read", items, ready=event)
        st = a.wait(t, timeout=30)
        assert st.state == kvbridge.TransferState.DONE, st
        assert int((host != value).sum()) == 0, "a byte was read before the producer's event"


def test_a_read_of_another_processs_cuda_tensor_over_cuda_ipc_is_exact():
    child = textwrap.dedent('''
        import sys, torch, kvbridge
        e = kvbridge.Engine(name="peer", transports=["cuda_ipc"])
        t = torch.arange(1 << 24, dtype=torch.int32, device="cuda:0")
        r = e.register_memory(t)
        ev = torch.cuda.Event(interprocess=True)
        ev.record()
        print(r, e.metadata().hex(), bytes(ev.ipc_handle()).hex(), flush=True)
        sys.stdin.readline()
    ''')
    p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 3, p.stderr.read()
        region, meta, handle = int(line[0]), bytes.fromhex(line[1]), bytes.fromhex(line[2])
        e = kvbridge.Engine(name="reader", transports=["cuda_ipc"])
        mine = torch.zeros(1 << 24, dtype=torch.int32, device="cuda:0")
        rm = e.register_memory(mine)
        peer = e.connect(meta)
        t = e.submit(peer, "read", [kvbridge.TransferItem(rm, 0, region, 0, mine.numel() * 4)], ready=handle)
        st = e.wait(t, timeout=30)
        assert st.state == kvbridge.TransferState.DONE, st
        assert torch.equal(mine, torch.arange(1 << 24, dtype=torch.int32, device="cuda:0"))
    finally:
        p.stdin.close()
        p.wait(timeout=30)
