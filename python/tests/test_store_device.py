"""The prefix store with KV caches in device memory (the host fake, KVB_DEVICE=fake, in a child
process): RankStore.put/get move them through pinned host memory after their events, and the
connector's combined loads read the stored prefix into device caches and the rest from prefill."""
import os
import subprocess
import sys
import textwrap

BODY = '''
    import ctypes, pickle, time, types
    import torch
    import kvbridge
    from kvbridge import connector_v1 as c1, testing

    assert testing.device_name() == "fake"
    LAYERS, HEADS, HS, BLOCKS, BS = 2, 4, 32, 8, 16

    class FakeCuda:
        """A torch tensor over the fake's device memory that says it is on cuda:0."""
        def __init__(self, t):
            self._t = t
        @property
        def device(self):
            return types.SimpleNamespace(type="cuda", index=0)
        def __getitem__(self, i):
            return FakeCuda(self._t[i])
        def __getattr__(self, name):
            return getattr(self._t, name)

    def caches():
        """Device caches (FakeCuda) and host views of the same bytes (for filling and checking)."""
        dev, host = {}, {}
        for i in range(LAYERS):
            n = 2 * BLOCKS * BS * HEADS * HS * 2
            ptr = testing.device_allocate(0, n)
            t = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
            t.zero_()
            shaped = t.view(torch.bfloat16).view(2, BLOCKS, BS, HEADS, HS)
            dev[f"layers.{i}"] = FakeCuda(shaped)
            host[f"layers.{i}"] = shaped
        return dev, host

    def req(n, blocks, skip=0):
        return kvbridge.Request(n, {"full": (blocks, [])}, skip_tokens=skip)

    # RankStore on device memory: the put waits for the producer's event (its bytes land 50 ms
    # later), the get for the blocks' previous owner (zeros landing 50 ms later).
    dev, host = caches()
    probe = c1.WorkerConnector(c1.ConnectorConfig(instance_id="probe", model="toy", num_kv_heads=HEADS), 0)
    layout = probe.register_kv_caches(dev)
    probe.close()
    store = kvbridge.Store(hash_block_tokens=16, memory_bytes=64 << 20)
    rs = kvbridge.RankStore(store, layout, dev, staging_bytes=256 << 10, staging_chunk_bytes=64 << 10)
    tokens = list(range(1000, 1048))
    pattern = {k: torch.empty_like(v) for k, v in host.items()}
    kvbridge.fill_request(layout, req(48, [1, 2, 3]), pattern, side="local", seed=5)
    late = [(host[k].data_ptr(), pattern[k].data_ptr(), host[k].numel() * 2) for k in host]
    handle = testing.device_copy_later(0, late, 0.05)
    put = rs.put(tokens, req(48, [1, 2, 3]), ready=handle)
    assert put.bytes_copied > 0, put
    for v in host.values():
        v.zero_()
    testing.device_drain(0)
    zeros = {k: torch.zeros_like(v) for k, v in host.items()}
    late = [(host[k].data_ptr(), zeros[k].data_ptr(), host[k].numel() * 2) for k in host]
    handle = testing.device_copy_later(0, late, 0.05)
    got = rs.get(tokens, req(48, [5, 6, 7]), ready=handle)
    testing.device_drain(0)
    assert got.hit_tokens == 48, got
    report = kvbridge.check_request(layout, req(48, [5, 6, 7]), host, side="local", seed=5)
    assert report.ok and report.cells > 0, report.first_error
    print("rank store ok")

    # The connector: a decode instance with device caches stores a finished request's prefix
    # (from its device caches), then a combined load reads that prefix from the store into
    # device caches and the rest from prefill.
    class Instance:
        def __init__(self, name, role, **extra):
            self.config = c1.ConnectorConfig(instance_id=name, role=role, model="toy", num_kv_heads=HEADS,
                                             store_hash_block_tokens=16, store_memory_bytes=64 << 20, **extra)
            self.dev, self.host = caches()
            self.worker = c1.WorkerConnector(self.config, 0)
            self.layout = self.worker.register_kv_caches(self.dev)
            self.scheduler = c1.SchedulerConnector(self.config, layout=self.layout)
            self.scheduler.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata()})

        def step(self):
            meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta()))
            w = self.worker
            w.bind_connector_metadata(meta)
            w.start_load_kv()
            for layer in kvbridge.layer_order(w.layout):
                w.wait_for_layer_load(layer)
                w.save_kv_layer(layer)
            w.wait_for_save()
            w.clear_connector_metadata()
            self.scheduler.update_connector_output([pickle.loads(pickle.dumps(w.build_connector_worker_meta()))])
            return self.scheduler.take_finished()

        def run_until(self, pred, also=()):
            seen = c1.FinishedRequests()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                for other in also:
                    other.step()
                f = self.step()
                seen.finished_sending |= f.finished_sending
                seen.finished_recving |= f.finished_recving
                seen.outcomes.update(f.outcomes)
                if pred(seen):
                    return seen
                time.sleep(0.01)
            raise AssertionError(f"not reached: {seen}")

    p = Instance("prefill", "prefill")
    d = Instance("decode", "decode")
    shared = list(range(500, 532))
    assert d.scheduler.get_num_new_matched_tokens("req-0", shared + [7], 0) == (0, False)
    d.scheduler.update_state_after_alloc("req-0", [1, 2], 0)
    kvbridge.fill_request(d.layout, req(33, [1, 2, 3]), d.host, side="local", seed=1)
    assert d.scheduler.request_finished("req-0", [1, 2, 3]) == (True, None)
    d.run_until(lambda f: "req-0" in f.finished_sending)
    prompt = shared + list(range(900, 924))  # 56 tokens
    n, _ = p.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, {"do_remote_decode": True})
    p.scheduler.update_state_after_alloc("req-1", [4, 5, 6, 7], n)
    kvbridge.fill_request(p.layout, req(56, [4, 5, 6, 7]), p.host, side="local", seed=2)
    ok, params = p.scheduler.request_finished("req-1", [4, 5, 6, 7])
    p.step()
    n, is_async = d.scheduler.get_num_new_matched_tokens("req-1", prompt, 0, params)
    assert (n, is_async) == (56, True), (n, is_async)
    d.scheduler.update_state_after_alloc("req-1", [4, 5, 6, 7], n)
    seen = d.run_until(lambda f: "req-1" in f.finished_recving, also=[p])
    assert seen.outcomes["req-1"].outcome == "finished", seen.outcomes["req-1"].error
    for first, count, seed in ((0, 32, 1), (32, 56, 2)):
        report = kvbridge.check_request(d.layout, req(count, [4, 5, 6, 7]), d.host, side="local",
                                        first_token=first, seed=seed)
        assert report.ok and report.cells > 0, (first, report.first_error)
    assert d.worker.store is not None
    print("combined load ok")
    p.worker.close(); d.worker.close()
'''


def test_the_store_moves_device_caches_after_their_events_and_combined_loads_fill_them():
    """RankStore on device memory: a put waits for the producer's event and a get for the blocks'
    previous owner (each 50 ms late on the fake; without the wait the bytes are wrong), and what
    comes back is byte-exact. Then the connector: a decode instance stores a prefix from its
    device caches, and a combined load reads it from the store into device caches and only the
    rest from prefill, both parts checked byte for byte."""
    env = dict(os.environ, KVB_DEVICE="fake")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(BODY)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank store ok" in r.stdout and "combined load ok" in r.stdout, r.stdout
