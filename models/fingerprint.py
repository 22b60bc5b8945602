"""Content fingerprints of model files, memoised by (path, size, mtime) in the cache dir."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """relay's cache folder: $RELAY_CACHE_DIR, else $XDG_CACHE_HOME/relay, else ~/.cache/relay."""
    env = os.environ.get("RELAY_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relay"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def stat_record(path: Path) -> dict:
    """What changes when a file is written, replaced, touched or copied."""
    st = Path(path).stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def sample_sha256(path: Path, head: int, windows: int = 8, window: int = 1 << 20) -> str:
    """sha256 of the file's size, its first `head` bytes (a safetensors header) and
    `windows` windows of `window` bytes spread evenly from its start to its end: a few
    MiB read whatever the file's size. It tells a file apart from a truncated, padded or
    partly copied one and from one whose header changed; a change elsewhere needs the
    full sha256 to be seen."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        h.update(f"{size}|{head}|".encode())
        f.seek(0)
        h.update(f.read(head))
        span = max(size - window, 0)
        for k in range(windows):
            f.seek(span * k // max(windows - 1, 1))
            h.update(f.read(window))
    return h.hexdigest()


def file_fingerprint(path: Path) -> str:
    """sha256 of the file's bytes; re-hashed only when its size or mtime changed."""
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = cache_dir() / "fingerprints" / f"{key}.json"
    try:
        record = json.loads(memo.read_text())
        if record.get("path") == str(path) and record.get("size") == st.st_size \
                and record.get("mtime_ns") == st.st_mtime_ns:
            return record["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(path), "size": st.st_size,
                                   "mtime_ns": st.st_mtime_ns, "sha256": digest}))
        os.replace(tmp, memo)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def combine(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
