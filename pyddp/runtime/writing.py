"""Files pyddp's tools write at a path the user names (a Chrome trace, a
benchmark's JSON and chart, a simulator profile): written whole or not at
all (into a temporary file beside it, then renamed over it), and never
through a symbolic link, which the file replaces rather than follows (the
file a link pointed at is left alone). A file already there is replaced;
missing folders above it are made. (The Trainer's run folder has its own,
stricter rules: train/files.py.)"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def write_atomic(path: Any, write: Callable[[Path], None]) -> Path:
    """`write(temporary)` writes the whole file; it then takes `path`'s place."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a directory is there; name a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: Any, text: str) -> Path:
    """`text` (UTF-8) as the whole file at `path`, as write_atomic writes it."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
