"""Shared fixtures of the kvbridge Python tests.

Run by ctest (python_test) with PYTHONPATH at the build tree's package; every
test that waits does so with a deadline.
"""
import os
import pathlib
import shutil
import socket
import subprocess
import time

import numpy as np
import pytest
import torch

import kvbridge

EXAMPLES = pathlib.Path(os.environ.get("KVB_EXAMPLES", pathlib.Path(__file__).resolve().parents[2] / "examples"))

# A vLLM-shaped cache: per layer [2 (K, V), num_blocks, block_size, heads, head_size].
LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 2, 8, 16, 4, 32


def torch_caches(fill_seed=None, heads=HEADS, dtype=torch.bfloat16):
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, heads, HEAD_SIZE)
    if fill_seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(fill_seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def torch_spec(kv, **extra):
    spec = {
        "model": "toy",
        "tensors": {f"kv.{i}": t for i, t in enumerate(kv)},
        "dims": "block position head cell",
        "groups": {"full": {"layers": {f"layers.{i}": {"k": t[0], "v": t[1]} for i, t in enumerate(kv)}}},
    }
    spec.update(extra)
    return spec


@pytest.fixture
def small_layout():
    return kvbridge.make_preset("llama3-8b", num_blocks=8)


@pytest.fixture
def torch_pair():
    """(prefill caches, prefill layout, decode caches, decode layout)."""
    p = torch_caches(fill_seed=7)
    d = torch_caches()
    return p, kvbridge.layout_from_tensors(torch_spec(p)), d, kvbridge.layout_from_tensors(torch_spec(d))


def host_arrays(layout, fill=0):
    return [np.full(t.bytes, fill, dtype=np.uint8) for t in layout.tensors]


def required(capability):
    """Whether CI requires `capability` (KVB_REQUIRE): then its absence fails, never skips."""
    return capability in os.environ.get("KVB_REQUIRE", "").split(",")


@pytest.fixture
def redis_address():
    """A redis-server of the test's own on a free loopback port (no persistence), stopped after."""
    exe = shutil.which("redis-server")
    if exe is None:
        if required("redis"):
            pytest.fail("redis-server is not installed, and KVB_REQUIRE requires redis")
        pytest.skip("redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--loglevel", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
