"""The prefix store with KV caches in device memory (the host fake, KVB_DEVICE=fake, in a child
process): RankStore.put/get move them through pinned host memory after their events, and the
connector's combined loads read the stored prefix into device caches and the rest from prefill."""
import os
import subprocess
import sys
import textwrap

BODY = '''
    import sys
    sys.path.insert(0, TESTS)
    import torch
    import kvbridge
    from kvbridge import connector_v1 as c1, testing
    from fake_cuda import device_caches
    import test_connector_v1 as host_tests

    assert testing.device_name() == "fake"
    LAYERS, HEADS, HS, BLOCKS, BS = 2, 4, 32, 8, 16
    names = [f"layers.{i}" for i in range(LAYERS)]

    def req(n, blocks):
        return kvbridge.Request(n, {"full": (blocks, [])})

    # RankStore on device memory: the put waits for the producer's event (its bytes land 50 ms
    # later), the get for the blocks' previous owner (zeros landing 50 ms later).
    dev, host, ptrs = device_caches(names, (2, BLOCKS, BS, HEADS, HS))
    probe = c1.WorkerConnector(c1.ConnectorConfig(instance_id="probe", model="toy", num_kv_heads=HEADS), 0)
    layout = probe.register_kv_caches(dev)
    probe.close()
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=64 << 20)
    rs = kvbridge.RankStore(store, layout, dev, staging_bytes=256 << 10, staging_chunk_bytes=64 << 10)
    tokens = list(range(1000, 1048))
    pattern = {k: torch.empty_like(v) for k, v in host.items()}
    kvbridge.fill_request(layout, req(48, [1, 2, 3]), pattern, side="local", seed=5)
    late = [(host[k].data_ptr(), pattern[k].data_ptr(), host[k].numel() * 2) for k in host]
    put = rs.put(tokens, req(48, [1, 2, 3]), ready=testing.device_copy_later(0, late, 0.05))
    assert put.bytes_copied > 0, put
    testing.device_drain(0)
    for v in host.values():
        v.zero_()
    zeros = {k: torch.zeros_like(v) for k, v in host.items()}
    late = [(host[k].data_ptr(), zeros[k].data_ptr(), host[k].numel() * 2) for k in host]
    got = rs.get(tokens, req(48, [5, 6, 7]), ready=testing.device_copy_later(0, late, 0.05))
    testing.device_drain(0)
    assert got.hit_tokens == 48, got
    report = kvbridge.check_request(layout, req(48, [5, 6, 7]), host, side="local", seed=5)
    assert report.ok and report.cells > 0, report.first_error
    for ptr in ptrs.values():
        testing.device_free(ptr)
    print("rank store ok")

    # The connector's combined load, as test_connector_v1 runs it on host caches, with every
    # rank's caches in device memory: a decode instance (TP 2, 32-token blocks) stores a prefix
    # from its device caches, then a load reads that prefix from the store into them and only
    # the rest from prefill (TP 1, 16-token blocks), both parts checked byte for byte.
    made = []

    def pd(prefill_kw=None, decode_kw=None, prefill_tp=1, decode_tp=2):
        p = host_tests.Instance("prefill", "prefill", prefill_tp, 16, device=True, **(prefill_kw or {}))
        d = host_tests.Instance("decode", "decode", decode_tp, 32, device=True, **(decode_kw or {}))
        made.extend([p, d])
        return p, d

    host_tests.test_a_combined_load_reads_the_stored_prefix_from_the_store_and_only_the_rest_from_prefill(pd)
    assert all(w.store is not None for w in made[1].workers)
    for inst in made:
        inst.close()
    print("combined load ok")
'''


def test_the_store_moves_device_caches_after_their_events_and_combined_loads_fill_them():
    """RankStore on device memory: a put waits for the producer's event and a get for the blocks'
    previous owner (each 50 ms late on the fake; without the wait the bytes are wrong), and what
    comes back is byte-exact. Then the connector: a decode instance stores a prefix from its
    device caches, and a combined load reads it from the store into device caches and only the
    rest from prefill, both parts checked byte for byte."""
    env = dict(os.environ, KVB_DEVICE="fake")
    body = f"TESTS = {os.path.dirname(os.path.abspath(__file__))!r}\n" + textwrap.dedent(BODY)
    r = subprocess.run([sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank store ok" in r.stdout and "combined load ok" in r.stdout, r.stdout
