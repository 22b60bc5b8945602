"""What a job says when its output cannot be written: one sentence naming the path, the
cause and the fix.

A disk that fills, a file-size limit, a folder made read-only or removed while a job
runs: each is an `OutputError` (a `RelayError`, so the CLI prints one line and exits
with status 2). The answers saved before it stay in their parts, and the same command
with `--resume` answers the rest.
"""

from __future__ import annotations

import errno
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from relaycli.errors import RelayError

RESUME = "then run the same command with --resume"
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


class OutputError(RelayError):
    """The output cannot be written or finished; the message is one sentence for the user."""


def _cause(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def write_failure(path: Path, exc: OSError) -> OutputError:
    """A failed write of path as one sentence: the path, the cause, what to do."""
    folder, code = path.parent, exc.errno
    if code in _FULL:
        fix = "free space or choose another --out"
    elif code == errno.EFBIG:
        fix = "raise the file-size limit (ulimit -f) or choose another --out"
    elif code in _DENIED:
        fix = f"make {folder} writable or choose another --out"
    elif code == errno.ENOENT:
        while not folder.parent.exists() and folder.parent != folder:
            folder = folder.parent  # the highest folder that is gone
        fix = f"the folder {folder} was removed: create it again or choose another --out"
    else:
        fix = "check the disk, free space or choose another --out"
    return OutputError(f"cannot write {path} ({_cause(exc)}); {fix}, {RESUME}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """OSErrors inside (pyarrow's IO errors are OSErrors too) become write_failure(path)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as exc:
        raise write_failure(path, exc) from None


def read_failure(path: Path, exc: BaseException) -> OutputError:
    """A saved part that cannot be read back while OUT is made: resume drops it and
    answers its rows again."""
    return OutputError(f"cannot read the saved answers {path} back ({_cause(exc)}); run the same command "
                       "with --resume to answer their rows again")
