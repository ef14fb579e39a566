"""Engine: registering torch tensors and numpy arrays, metadata, connect,
submit, wait (GIL released), cancel, notifications, metrics."""
import threading
import time
import types

import numpy as np
import pytest
import torch

import kvbridge


@pytest.fixture
def pair():
    with kvbridge.Engine(name="eng-a") as a, kvbridge.Engine(name="eng-b") as b:
        yield a, b


def test_help_reads_well():
    doc = kvbridge.Engine.__doc__
    assert "Registered memory, peers and asynchronous transfers" in doc
    assert "register_memory" in kvbridge.Engine.register_memory.__doc__
    assert kvbridge.Engine.__module__ == "kvbridge"
    text = []
    import pydoc
    text = pydoc.render_doc(kvbridge.Engine, renderer=pydoc.plaintext)
    assert "wait(" in text and "GIL released" in text


def test_read_and_write_between_torch_and_numpy(pair):
    a, b = pair
    src = torch.arange(4096, dtype=torch.int32)  # torch on one side
    dst = np.zeros(4096 * 4, np.uint8)           # numpy on the other
    ra, rb = a.register_memory(src), b.register_memory(dst)
    peer = b.connect(a.metadata())
    t = b.submit(peer, "read", [kvbridge.TransferItem(rb, 0, ra, 0, 8192)], notification="read done")
    status = b.wait(t, timeout=10)
    assert status.ok and status.bytes_done == 8192, status
    assert np.array_equal(dst[:8192].view(np.int32), np.arange(2048, dtype=np.int32))
    assert not dst[8192:].any()
    dst[:] = 7
    t = b.submit(peer, kvbridge.TransferOp.WRITE, np.array([[rb, 0, ra, 16, 4]]), timeout=5.0)
    assert b.wait(t, timeout=10).ok
    assert src[4].item() == 0x07070707
    b.release(t)
    deadline = time.monotonic() + 10
    notes = []
    while not notes and time.monotonic() < deadline:
        notes = a.take_notifications()
        time.sleep(0.01)
    assert [(n.peer, n.message, n.text) for n in notes] == [("eng-b", b"read done", "read done")]
    m = b.metrics()
    assert m.transfers_done == 2 and m.bytes_read == 8192 and m.bytes_written == 4
    assert m.to_dict()["descriptors"] == 2 and len(m.latency_us_buckets) == 16
    assert "kvbridge_" in b.metrics_prometheus()


def test_host_memory_is_a_huge_page_buffer_that_torch_numpy_and_the_engine_use(pair):
    a, b = pair
    mem = kvbridge.HostMemory(3 << 20)
    assert mem.nbytes == len(mem) == 3 << 20 and mem.address % (2 << 20) == 0
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read()
    assert mem.huge_pages == ("[never]" not in thp), mem.huge_pages_note
    src = torch.frombuffer(mem, dtype=torch.int32)  # the engine's KV, in HostMemory
    src[:] = torch.arange(src.numel(), dtype=torch.int32)
    dst = np.frombuffer(kvbridge.HostMemory(1 << 20), dtype=np.int32)  # a view keeps it alive
    dst[:] = 0
    ra, rb = a.register_memory(mem), b.register_memory(dst)
    peer = b.connect(a.metadata())
    t = b.submit(peer, "read", [kvbridge.TransferItem(rb, 0, ra, 4 << 10, 1 << 20)])
    assert b.wait(t, timeout=10).ok
    assert np.array_equal(dst, np.arange(1024, 1024 + (1 << 18), dtype=np.int32))
    with pytest.raises(kvbridge.InvalidArgument, match="0 bytes"):
        kvbridge.HostMemory(0)
    with pytest.raises(kvbridge.ResourceExhausted, match="mmap of 4611686018427387904 bytes"):
        kvbridge.HostMemory(1 << 62)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 18])
def test_inline_bytes_decides_where_small_transfers_run(inline_bytes):
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, np.uint8)
    with kvbridge.Engine(name="in-a", inline_bytes=inline_bytes) as a, kvbridge.Engine(name="in-b") as b:
        ra, rb = a.register_memory(dst), b.register_memory(src)
        peer = a.connect(b.metadata())
        t = a.submit(peer, "read", [(ra, 0, rb, 0, 4096)])
        if inline_bytes:
            # Ran inside submit(): ended before any wait.
            assert a.status(t).state == kvbridge.TransferState.DONE
        assert a.wait(t, timeout=10).ok
        assert np.array_equal(dst, src)


def test_notify_on_its_own(pair):
    a, b = pair
    peer = a.connect(b.metadata())
    a.notify(peer, b"\x00binary")
    deadline = time.monotonic() + 10
    notes = []
    while not notes and time.monotonic() < deadline:
        notes = b.take_notifications()
        time.sleep(0.01)
    assert notes[0].message == b"\x00binary"


def test_wait_releases_the_gil():
    a_mem = np.zeros(4096, np.uint8)
    b_mem = np.ones(4096, np.uint8)
    with kvbridge.testing.engine_with_faults("delay=400", name="gil-a") as a, kvbridge.Engine(name="gil-b") as b:
        ra, rb = a.register_memory(a_mem), b.register_memory(b_mem)
        peer = a.connect(b.metadata())
        ticks = []
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.005)

        t = a.submit(peer, "read", [(ra, 0, rb, 0, 4096)])
        th = threading.Thread(target=spin)
        th.start()
        status = a.wait(t, timeout=10)
        stop.set()
        th.join()
        assert status.ok and a_mem.all()
        assert len(ticks) > 20  # the Python thread ran during the 400 ms wait


def test_registration_keeps_the_object_and_checks_it(pair):
    a, _ = pair
    t = torch.zeros(1024)
    r = a.register_memory(t)
    assert a.register_memory(t) == r  # the same range: the same id, counted
    a.deregister_memory(r)
    a.deregister_memory(r)
    with pytest.raises(kvbridge.NotFound):
        a.deregister_memory(r)
    with pytest.raises(kvbridge.InvalidArgument, match="not contiguous"):
        a.register_memory(torch.zeros(8, 8).t())
    with pytest.raises(kvbridge.InvalidArgument, match="writable"):
        a.register_memory(b"read-only bytes")
    with pytest.raises(kvbridge.InvalidArgument, match="device 'meta'"):
        a.register_memory(torch.zeros(8, device="meta"))
    raw = np.zeros(64, np.uint8)
    assert a.register_memory((raw.ctypes.data, raw.nbytes)) > 0


def test_a_cuda_tensor_needs_a_cuda_build(pair):
    a, _ = pair
    # A stand-in with torch's interface, on a CUDA device (this build and torch are CPU-only).
    host = torch.zeros(16)
    fake = types.SimpleNamespace(data_ptr=host.data_ptr, element_size=host.element_size, numel=host.numel,
                                 is_contiguous=lambda: True, device=types.SimpleNamespace(type="cuda", index=1))
    if kvbridge.has_cuda:
        pytest.skip("this build has CUDA")
    with pytest.raises(kvbridge.InvalidArgument, match="cuda:1.*CUDA"):
        a.register_memory(fake)


def test_submit_checks_items_before_anything_moves(pair):
    a, b = pair
    mem_a, mem_b = np.zeros(64, np.uint8), np.zeros(64, np.uint8)
    ra, rb = a.register_memory(mem_a), b.register_memory(mem_b)
    peer = a.connect(b.metadata())
    with pytest.raises(kvbridge.OutOfRange):
        a.submit(peer, "read", [(ra, 0, rb, 60, 8)])
    with pytest.raises(kvbridge.InvalidArgument):
        a.submit(peer, "read", [])
    with pytest.raises(kvbridge.NotFound):
        a.submit(999, "read", [(ra, 0, rb, 0, 8)])
    with pytest.raises(kvbridge.InvalidArgument):
        a.connect(b"not metadata")
    assert a.status(12345).error.code == "not_found"


def test_close_is_idempotent_and_later_calls_raise():
    e = kvbridge.Engine(name="closing")
    assert [t.name for t in e.transports()]
    e.close()
    e.close()
    assert e.closed
    with pytest.raises(kvbridge.Unavailable, match="closed"):
        e.metadata()


def test_fault_injection_is_a_testing_hook_not_an_engine_argument():
    with pytest.raises(TypeError):
        kvbridge.Engine(name="faulty", faults="delay=1")
    assert "faults" not in kvbridge.Engine.__init__.__doc__
    with kvbridge.testing.engine_with_faults("delay=1", name="faulty") as e:
        assert isinstance(e, kvbridge.Engine) and e.name == "faulty"
        assert [t.name for t in e.transports()]
    with pytest.raises(kvbridge.InvalidArgument):
        kvbridge.testing.engine_with_faults("no-such-fault=1")

def test_a_wildcard_bind_needs_an_address_to_advertise():
    with pytest.raises(kvbridge.InvalidArgument, match="give advertise_host"):
        kvbridge.Engine(name="wild", transports=["tcp"], host="0.0.0.0")
    with kvbridge.Engine(name="wild", transports=["tcp"], host="0.0.0.0", advertise_host="127.0.0.1") as e:
        blob = e.metadata()
        assert b"0.0.0.0" not in blob and b"127.0.0.1:" in blob
