"""The pieces of a lifecycle world (lifecycle.py): its configuration, its ranks and instances
(real engines and connector_v1 workers over host memory or the host fake's device memory), and
a request's record. lifecycle.py drives them; see its docstring for what is checked.
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

import kvbridge
from kvbridge import connector_v1 as c1
from fake_cuda import device_caches

if TYPE_CHECKING:
    from lifecycle import World

LAYERS, HEADS, HEAD_SIZE = 2, 4, 16
PREFILL_BLOCKS, DECODE_BLOCKS = 24, 24
POISON = 0x5A  # what a freed decode block holds until it is given out again
GRACE_S = 3.0


class Violation(AssertionError):
    pass


def device_fake() -> bool:
    try:
        return kvbridge.testing.device_name() == "fake"
    except Exception:
        return False


@dataclasses.dataclass
class WorldConfig:
    seed: int
    prefill_tp: int
    decode_tp: int
    decode_block: int
    device: bool
    transport: str
    drop: int         # per mille of control messages lost
    duplicate: int    # per mille sent twice
    read_delay_ms: int
    lease_s: float
    heartbeat_s: float
    load_timeout_s: float
    producer_delay_s: float
    concurrency: int
    verify_content: bool  # every load's bytes hashed at the source and where they landed (device memory on the device)

    @staticmethod
    def draw(seed: int, device_ok: bool) -> "WorldConfig":
        r = random.Random(seed)
        device = device_ok and r.random() < 0.35
        short_lease = r.random() < 0.3
        # A short lease comes with lost messages and slow reads: holds that expire under a read.
        return WorldConfig(
            seed=seed, prefill_tp=r.choice([1, 2]), decode_tp=r.choice([1, 2]), decode_block=r.choice([16, 32]),
            device=device, transport="local" if device else r.choice(["local", "local", "tcp"]),
            drop=r.choice([150, 300]) if short_lease else r.choice([0, 0, 30, 80]), duplicate=r.choice([0, 0, 50]),
            read_delay_ms=0 if device else (r.choice([5, 10]) if short_lease else r.choice([0, 0, 0, 2])),
            lease_s=0.3 if short_lease else 3.0, heartbeat_s=0.1,
            load_timeout_s=2.0, producer_delay_s=r.choice([0.002, 0.01]) if device else 0.0,
            concurrency=r.choice([4, 6, 8]), verify_content=True)


class Rank:
    """One rank's caches (host memory, or the fake's device memory with a host mirror the
    content functions write) and its worker half."""

    def __init__(self, config: c1.ConnectorConfig, rank: int, blocks: int, block_size: int, device: bool) -> None:
        heads = HEADS // config.tp_size
        shape = (2, blocks, block_size, heads, HEAD_SIZE)
        names = [f"layers.{i}" for i in range(LAYERS)]
        self.device = device
        self.host: Dict[str, torch.Tensor] = {}   # what the content functions read and write
        self.caches: Dict[str, Any] = {}          # what is registered
        self.ptrs: Dict[str, int] = {}
        if device:
            self.caches, self.host, self.ptrs = device_caches(names, shape)
        else:
            self.host = {name: torch.zeros(shape, dtype=torch.bfloat16) for name in names}
            self.caches = dict(self.host)
        self.worker = c1.WorkerConnector(config, rank)
        self.layout = self.worker.register_kv_caches(self.caches)

    def close(self) -> None:
        self.worker.close()
        for ptr in self.ptrs.values():
            kvbridge.testing.device_free(ptr)
        self.ptrs.clear()


class Instance:
    def __init__(self, w: "World", role: str, tp: int, block_size: int, blocks: int) -> None:
        cfg = w.cfg
        faults = [f"seed={cfg.seed * 7 + w.restarts + (1 if role == 'decode' else 0)}"]
        if cfg.drop:
            faults.append(f"drop-rate={cfg.drop}")
        if cfg.duplicate:
            faults.append(f"duplicate-rate={cfg.duplicate}")
        if role == "decode" and cfg.read_delay_ms:
            faults.append(f"delay={cfg.read_delay_ms}")
        self.config = c1.ConnectorConfig(
            instance_id=role, role=role, tp_size=tp, model="toy", num_kv_heads=HEADS, lease_s=cfg.lease_s,
            heartbeat_s=cfg.heartbeat_s, load_timeout_s=cfg.load_timeout_s, handshake_timeout_s=1.0,
            stream=cfg.device, transports=(cfg.transport,), engine_faults=",".join(faults), load_chunk_tokens=32,
            verify_content=cfg.verify_content)
        self.block_size = block_size
        self.blocks = blocks
        self.ranks = [Rank(self.config, r, blocks, block_size, cfg.device) for r in range(tp)]
        self.scheduler = c1.SchedulerConnector(self.config, layout=self.ranks[0].layout)
        self.scheduler.set_xfer_handshake_metadata([r.worker.get_handshake_metadata() for r in self.ranks])
        self.free = list(range(1, blocks))  # block 0 is never given out
        self.releases: List[Any] = []       # (request, reason) of the PrefillScheduler, recorded
        inner = self.scheduler._prefill
        outer = self

        class Recording:
            """The scheduler half's PrefillScheduler, recording each release's reason."""

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def take_releases(self, now: Optional[float] = None) -> List[Any]:
                out = inner.take_releases(now)
                outer.releases.extend(out)
                return out

        self.scheduler._prefill = Recording()

    def handshakes(self) -> List[c1.HandshakeMetadata]:
        return [r.worker.get_handshake_metadata() for r in self.ranks]

    def content_checked(self) -> int:
        """Bytes its engines' content check (verify_content) found equal on both sides."""
        return sum(r.worker.engine.metrics().bytes_content_checked for r in self.ranks if r.worker.engine)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


@dataclasses.dataclass
class Req:
    rid: str
    seed: int
    tokens: List[int]
    pblocks: List[int]
    stream: bool
    prefill_gen: int
    pstate: str = "computing"   # admitted (host) | computing (streamed) | ready | held | done
    dstate: str = "none"        # none | blocks | loading | aborting | done
    dblocks: List[int] = dataclasses.field(default_factory=list)
    decode_gen: int = -1
    params: Optional[Dict[str, Any]] = None
    layers_done: int = 0
    handed_at: Optional[float] = None
    abort_at: Optional[str] = None  # the decode stage it is aborted at: before-meta, loading, after
    abort_steps: int = 0
    prefill_abort: bool = False
    released_under_read: bool = False
    outcome: Optional[str] = None
    trace: List[str] = dataclasses.field(default_factory=list)  # what happened to it, for a violation

    def note(self, what: str) -> None:
        self.trace.append(f"{time.monotonic() % 1000:.3f} {what}")
