"""The `--devices` list: which worker processes a job starts, one per entry."""

from __future__ import annotations

import os
import re

from relaycli.errors import ConfigError

_DEVICE = re.compile(r"cpu|cuda:\d+")


def parse_devices(text: str) -> list[str]:
    """`cuda:0,cuda:1`, `all` (every visible GPU) or `cpu,cpu` -> the device of each worker."""
    if text.strip() == "all":
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError("--devices all: this machine shows no CUDA GPU; name the devices instead, "
                              "e.g. --devices cpu,cpu")
        return [f"cuda:{i}" for i in range(count)]
    devices = [item.strip() for item in text.split(",")]
    check_devices(devices)
    return devices


def check_devices(devices: list[str]) -> None:
    """Each entry is cpu or cuda:N, and no GPU is named twice (two workers would share its memory)."""
    if not devices:
        raise ConfigError("--devices is empty; name at least one device, e.g. --devices cuda:0")
    seen = set()
    for device in devices:
        if not isinstance(device, str) or not _DEVICE.fullmatch(device):
            hint = " (name the GPU: cuda:0)" if device == "cuda" else ""
            raise ConfigError(f"--devices: {device!r} is not a device{hint}; use cuda:N, cpu, or all")
        if device != "cpu" and device in seen:
            raise ConfigError(f"--devices names {device} twice; give each GPU one worker")
        seen.add(device)


def cpu_threads(devices: list[str]) -> int | None:
    """Intra-op threads of a CPU worker: the cores shared evenly among the CPU workers, unless
    OMP_NUM_THREADS sets them (None: torch's own choice, for GPU workers)."""
    n = devices.count("cpu")
    if n == 0 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // n)
