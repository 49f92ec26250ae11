"""Atomic file writes: a report or record is either the old file or the complete new one, never half of either."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO, Any


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> pathlib.Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
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


def write_json_atomic(path: str | os.PathLike, obj: Any) -> pathlib.Path:
    """JSON with sorted keys and a trailing newline; non-finite floats are written as strings ("inf", "nan")."""
    text = json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n"
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
