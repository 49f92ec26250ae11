"""Atomic file writes: a report or record is either the old file or the complete new one, never half of either."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO, Any


def current_umask() -> int:
    """The process's umask (Linux: read from /proc, without changing it; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> pathlib.Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``. The file gets
    the mode a plain ``open(path, "w")`` would give it (0666 less the umask), not the temporary file's 0600."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):  # POSIX
            os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> pathlib.Path:
    return write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_json_atomic(path: str | os.PathLike, obj: Any, *, sort_keys: bool = True) -> pathlib.Path:
    """JSON with sorted keys (``sort_keys=False``: in ``obj``'s order) and a trailing newline; non-finite floats are
    written as strings ("inf", "nan")."""
    text = json.dumps(_jsonable(obj), indent=2, sort_keys=sort_keys) + "\n"
    return write_text_atomic(path, text)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        if x != x:
            return "nan"
        if x in (float("inf"), float("-inf")):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
