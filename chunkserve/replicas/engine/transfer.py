"""Host lists to the device without waiting for it.

A tensor built from a Python list and moved to a GPU by a plain (blocking) copy from pageable
memory synchronizes the stream: the host waits for every step already queued. The engine's
asynchronous scheduling prepares a step while the one before runs, so its per-step inputs (token
ids, positions, chunk ids, sampling parameters and row indices) go through pinned memory instead.
"""

from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`; to a GPU without blocking the host."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
