"""KV caches in the host fake's device memory (KVB_DEVICE=fake), for the tests: torch views of
the fake's allocations that say they are on cuda:0 (what a rank registers), and plain torch views
of the same bytes (what the content functions fill and check)."""
import ctypes
import math
import types
from typing import Any, Dict, List, Tuple

import torch

import kvbridge


class FakeCuda:
    """A torch tensor over the fake's device memory that says it is on cuda:0."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    @property
    def device(self) -> Any:
        return types.SimpleNamespace(type="cuda", index=0)

    def __getitem__(self, i: Any) -> "FakeCuda":
        return FakeCuda(self._t[i])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def device_caches(names: List[str], shape: Tuple[int, ...], dtype: torch.dtype = torch.bfloat16
                  ) -> Tuple[Dict[str, FakeCuda], Dict[str, torch.Tensor], Dict[str, int]]:
    """One zeroed tensor of `shape` per name in the fake's device memory: (the FakeCuda views to
    register, host views of the same bytes, the allocations by name, to device_free())."""
    caches, host, ptrs = {}, {}, {}
    n = torch.tensor([], dtype=dtype).element_size() * math.prod(shape)
    for name in names:
        ptr = kvbridge.testing.device_allocate(0, n)
        raw = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
        raw.zero_()
        t = raw.view(dtype).view(*shape)
        caches[name], host[name] = FakeCuda(t), t
        ptrs[name] = ptr
    return caches, host, ptrs
