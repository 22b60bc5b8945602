"""What a process spends compiling Triton kernels: a job's first run on a machine compiles
each kernel variant it meets (seconds each); later runs load them from Triton's on-disk
cache. Counted through Triton's compilation listener (knobs.compilation.listener, where
this Triton has one), chained after any listener already installed.

Before it can load a kernel from that cache, a process computes Triton's key of the
installation once: a hash of its compiler's sources and its 500 MB library, about a
second, on the thread of the first launch. `start_cache_key` computes it beforehand, on a
thread beside torch's import and the model's load (the hashing releases the GIL), and
`prepare_cache_key` waits for that computation instead of hashing again."""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass, field

# One computation of the key at a time: a caller that comes while another thread hashes
# waits for its result (Triton caches it) rather than hashing the library a second time.
_KEY_LOCK = threading.Lock()


@dataclass
class CompileLog:
    compiled: int = 0  # variants compiled in this process (not in the on-disk cache)
    compile_seconds: float = 0.0
    loaded: int = 0  # variants found in the on-disk cache
    compiled_names: dict[str, int] = field(default_factory=dict)  # kernel name -> variants compiled
    _previous: object = None
    _installed: bool = False

    def install(self) -> "CompileLog":
        """Start counting (a no-op without Triton or its listener)."""
        try:
            from triton import knobs
            compilation = knobs.compilation
            self._previous = compilation.listener
        except (ImportError, AttributeError):
            return self

        def listener(*, src, metadata, metadata_group, times, cache_hit, **extra):
            if cache_hit:
                self.loaded += 1
            else:
                self.compiled += 1
                self.compile_seconds += (times.ir_initialization + times.total_lowering + times.store_results) / 1e6
                name = _kernel_name(src, metadata)
                self.compiled_names[name] = self.compiled_names.get(name, 0) + 1
            if self._previous is not None:
                self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                               cache_hit=cache_hit, **extra)

        compilation.listener = listener
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            from triton import knobs
            knobs.compilation.listener = self._previous
            self._installed = False

    def as_dict(self) -> dict:
        return {"triton_kernels_compiled": self.compiled, "triton_compile_seconds": self.compile_seconds,
                "triton_kernels_loaded": self.loaded, "triton_compiled_names": dict(self.compiled_names)}


def _kernel_name(src, metadata) -> str:
    """The compiled kernel's function name, from what this Triton's listener hands over."""
    try:
        return str(metadata["name"])
    except (KeyError, TypeError, IndexError):
        fn = getattr(src, "fn", None)
        return getattr(fn, "__name__", None) or getattr(src, "name", None) or "?"


def prepare_cache_key() -> None:
    """Compute Triton's key of this installation now, or wait for the thread computing it,
    so the first kernel launch finds it made (a no-op without Triton)."""
    with _KEY_LOCK:
        try:
            from triton.runtime.cache import triton_key
            triton_key()  # cached by Triton for the rest of the process
        except Exception:  # noqa: BLE001 - only a head start: the first launch computes it anyway
            pass


def start_cache_key(device: str | None) -> bool:
    """Start prepare_cache_key on a thread where a job on `device` (None: the default) may
    run Triton kernels: Triton is installed and an NVIDIA driver is present. It asks only
    the file system, so a process can start it before importing torch. Whether it started."""
    if device is not None and not device.startswith("cuda"):
        return False
    if not os.path.exists("/dev/nvidiactl") or importlib.util.find_spec("triton") is None:
        return False
    threading.Thread(target=prepare_cache_key, name="relay-triton-key", daemon=True).start()
    return True
