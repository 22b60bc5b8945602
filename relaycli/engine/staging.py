"""Host-to-device copies that do not wait for the step the GPU is running.

The engine prepares step t+1 while step t runs. A copy from pageable host memory may
synchronize with the stream first, which would serialize the two; a copy from pinned
memory is queued like a kernel. PyTorch's pinned-memory cache keeps a staging buffer
until the copy that reads it has run, so the buffers can be dropped at once.
"""

from __future__ import annotations

import torch


def stage(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`, copied without blocking (made contiguous and pinned on CUDA)."""
    if device.type != "cuda":
        return host.to(device)
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) list of numbers as a tensor on `device`, copied without blocking."""
    return stage(torch.tensor(values, dtype=dtype), device)
