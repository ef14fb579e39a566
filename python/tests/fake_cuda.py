"""KV caches in the host fake's device memory (KVB_DEVICE=fake), for the tests: torch views of
the fake's allocations that say they are on cuda:N (what a rank registers), and plain torch views
of the same bytes (what the content functions fill and check).

A test that runs its body in a child process puts this directory on the child's sys.path and
imports from here too: one FakeCuda for every test."""
import ctypes
import math
import types
from typing import Any, Dict, List, Tuple

import torch

import kvbridge


class FakeCuda:
    """A torch tensor over the fake's device memory that says it is on cuda:`index`."""

    def __init__(self, t: torch.Tensor, index: int = 0) -> None:
        self._t, self._index = t, index

    @property
    def device(self) -> Any:
        return types.SimpleNamespace(type="cuda", index=self._index)

    @property
    def host(self) -> torch.Tensor:
        """The same bytes as a plain torch tensor (the fake's device memory is host memory)."""
        return self._t

    def __getitem__(self, i: Any) -> "FakeCuda":
        return FakeCuda(self._t[i], self._index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


def cuda_empty(shape: Tuple[int, ...], dtype: torch.dtype = torch.bfloat16, index: int = 0) -> Tuple[FakeCuda, int]:
    """A zeroed tensor of `shape` in the fake's memory of device `index`: (its FakeCuda view, the
    allocation's address, for device_free())."""
    n = torch.tensor([], dtype=dtype).element_size() * math.prod(shape)
    ptr = kvbridge.testing.device_allocate(index, n)
    raw = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
    raw.zero_()
    return FakeCuda(raw.view(dtype).view(*shape), index), ptr


def device_caches(names: List[str], shape: Tuple[int, ...], dtype: torch.dtype = torch.bfloat16
                  ) -> Tuple[Dict[str, FakeCuda], Dict[str, torch.Tensor], Dict[str, int]]:
    """One zeroed tensor of `shape` per name in the fake's device memory: (the FakeCuda views to
    register, host views of the same bytes, the allocations by name, to device_free())."""
    caches, host, ptrs = {}, {}, {}
    for name in names:
        caches[name], ptrs[name] = cuda_empty(shape, dtype)
        host[name] = caches[name].host
    return caches, host, ptrs

