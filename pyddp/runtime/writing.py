"""Files pyddp's tools write at a path the user names (a Chrome trace, a
benchmark's JSON and chart, a simulator profile): written whole or not at
all (into a temporary file beside it, flushed to disk, then renamed over
it), and never through a symbolic link, which the file replaces rather than
follows (the file a link pointed at is left alone). A file already there
is replaced if it is writable (a read-only one is refused, as an in-place
write would be), keeping its mode; missing folders above it are made; a new
file gets the usual mode (0666 less the umask), not a temporary file's 0600. Where the
folder takes no new file but the file there is writable, it is written in
place (not atomic). A character device or a FIFO there, or a link to one
(/dev/null, /dev/stdout, a named pipe), is written into, as a shell's
redirection writes, and never replaced (a probe: /dev/null became a regular
file), and so is a path through /proc (/dev/stdout when your output goes to
a file); a block device or a socket there is refused."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Optional


def write_atomic(path: Any, write: Callable[[Path], None]) -> Path:
    """`write(temporary)` writes the whole file; it then takes `path`'s place."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a directory is there; name a file to write")
    kind = _special(path)
    if kind in ("a block device", "a socket"):
        raise OSError(errno.EINVAL, f"{kind} is there; name a file to write", str(path))
    if refusal(path) is not None:
        raise PermissionError(errno.EACCES, "not writable", str(path))
    if kind is not None:  # a stream: written into, never replaced
        write(path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.name.encode()[:64].decode(errors="ignore")  # (a short name, in bytes)
    tmp = path.parent / f".{stem}.{secrets.token_hex(4)}.tmp"
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # (the umask applies)
        if path.is_file() and not path.is_symlink():  # a file replaced keeps its mode
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
    except PermissionError:
        if not path.is_file() or path.is_symlink():
            raise
        write(path)  # a writable file in a folder that takes no new one: in place
        return path
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def is_stream(path: Path) -> bool:
    """A character device or FIFO at `path` (links followed), or a path
    through /proc (/dev/stdout -> /proc/self/fd/1 -> your log file): written
    into, never replaced (a review: /dev/stdout of a run whose output goes
    to a file was renamed over)."""
    return _special(path) == "a stream"


def _special(path: Path) -> Optional[str]:
    """What is at `path`, following links, when it is not a regular file, a
    folder or nothing."""
    hop, hops = os.path.abspath(path), 0
    while hops < 40:  # (a loop of links: os.stat below says so)
        if hop.startswith("/proc/"):
            return "a stream"  # a process's descriptor, whatever it leads to
        if not os.path.islink(hop):
            break
        hop, hops = os.path.normpath(os.path.join(os.path.dirname(hop), os.readlink(hop))), hops + 1
    try:
        mode = os.stat(path).st_mode
    except OSError:  # nothing there (or a dangling link: replaced)
        return None
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return "a stream"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def refusal(path: Path) -> Optional[str]:
    """Why write_atomic refuses `path` (None where it takes it): a folder
    there, or a file there it may not write (for root, any file is writable)."""
    if path.is_dir():
        return "is a folder there"
    if path.exists() and not path.is_symlink() and not os.access(path, os.W_OK):
        return "is read-only there"
    return None


def write_text(path: Any, text: str) -> Path:
    """`text` (UTF-8) as the whole file at `path`, as write_atomic writes it."""
    return write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
