"""Programmatic dependent launch (PDL) for the small kernels between a layer's products.

A CUDA kernel launched as a programmatic dependent (sm_90 and newer) may be launched, and
its programs placed, while the kernel before it on the stream is still finishing; it
waits in griddepcontrol.wait, the first thing it does, until that kernel has completed and
its writes are visible. Launch latency and the ramp-up then overlap the previous kernel's
tail. The kernels that take it here (add + RMSNorm, RoPE, silu * up) read only what the
kernel just before them wrote or what kernels before that wrote, and wait before any access,
so the results are the same to the bit with or without it; only where each launch starts
moves.
"""

from __future__ import annotations

import torch

from relaycli.kernels.triton_plan import is_hopper_or_newer


def pdl_supported(device: torch.device) -> bool:
    """Hopper or newer, NVIDIA (the launch attribute and griddepcontrol need sm_90)."""
    return is_hopper_or_newer(device)


def launch_options(pdl: bool) -> dict:
    """Triton launch keyword for a programmatic dependent (none otherwise, so that the
    interpreter and older GPUs see the plain launch)."""
    return {"launch_pdl": True} if pdl else {}
