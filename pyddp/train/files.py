"""Files the Trainer writes in an output directory that other users may share:
names are resolved against an open directory and never through a symbolic
link, temporaries get unpredictable names and are created exclusively, a
rewrite is atomic (temporary file, fsync, rename), and a Ctrl-C that arrives
while a file is half written is delivered once the write is complete."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import IO, Any, Callable, Iterator, List, Optional, Tuple

from ..errors import UnsafePathError
from ..runtime.signals import sigint_deferred

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at a name fails to open instead of blocking forever.
_READ = os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW


OUTPUT_ENV = "PYDDP_OUTPUT"


def output_root(name: str) -> str:
    """The default folder of pyddp's examples and `pyddp-bench`: NAME under
    $PYDDP_OUTPUT, else under `pyddp-runs/` in the working directory (one
    root, ignored by this repository's .gitignore)."""
    return os.path.join(os.environ.get(OUTPUT_ENV) or "pyddp-runs", name)


def _disk_full(error: BaseException) -> Optional[str]:
    """What says the disk is full in `error` or the exceptions it was
    raised from (None: something else failed)."""
    seen: Optional[BaseException] = error
    visited = set()
    while seen is not None and id(seen) not in visited:  # a chain may loop
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{type(seen).__name__}: {seen}"
        visited.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    if isinstance(error, RuntimeError) and "unexpected pos" in str(error):
        # torch's zip writer when a write stopped short: a full disk, as a rule
        return f"torch.save: the write stopped short, {str(error).strip()}"
    return None


class SafeDir:
    """A directory held open; files in it are named relative to it. The
    directory itself may be reached through links (it is the user's path);
    `subdir` and every file name are pyddp's and must not be links."""

    def __init__(self, path: Path, fd: int):
        self.path = Path(path)
        self.fd = fd

    @classmethod
    def open(cls, path: Path, *, create: bool = True) -> Optional[SafeDir]:
        """The directory at `path` (created if `create`), or None if missing."""
        path = Path(path)
        try:
            if create:
                path.mkdir(parents=True, exist_ok=True)  # (a file there: FileExistsError)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            if create:  # (/proc/x: no folder can be made there)
                raise OSError(f"pyddp: cannot create the folder {path}: {e.strerror}") from e
            return None
        except (NotADirectoryError, FileExistsError):
            raise UnsafePathError(
                errno.ENOTDIR, f"pyddp: cannot use {path} as a folder: it is not a directory"
            ) from None
        return cls(path, fd)

    def subdir(self, name: str, *, create: bool = True) -> Optional[SafeDir]:
        """The directory `name` in this one, refusing a link; None if missing."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_fd=self.fd)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._refusal(name, e) from None
        return SafeDir(self.path / name, fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafeDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --------------------------------------------------------------- reading
    def open_read(self, name: str) -> Optional[IO[bytes]]:
        """`name` opened for reading, None if missing; a link or a
        non-regular file raises UnsafePathError."""
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._refusal(name, e) from None
        return self._regular(fd, name, "rb")

    def read_text(self, name: str) -> Optional[str]:
        f = self.open_read(name)
        if f is None:
            return None
        with f:
            return f.read().decode("utf-8", errors="replace")

    def names(self) -> List[str]:
        """Entry names; a link among them is the caller's to refuse (`check`)."""
        return os.listdir(self.fd)

    def check(self, name: str) -> bool:
        """True if `name` is a regular file, False if missing; raises
        UnsafePathError if it is a link or something else."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise self._refusal(name)
        return True

    # --------------------------------------------------------------- writing
    def append(self, name: str, text: str) -> None:
        """Appends `text` to `name` (created if missing), whole or not at all
        as far as Ctrl-C goes."""
        with sigint_deferred(), self._naming_a_full_disk(name):
            try:
                fd = os.open(name, _APPEND, 0o666, dir_fd=self.fd)
            except OSError as e:
                raise self._refusal(name, e) from None
            with self._regular(fd, name, "ab") as f:
                f.write(text.encode("utf-8"))

    def write_atomic(self, name: str, write: Callable[[IO[bytes]], None]) -> None:
        """Replaces `name` by what `write(file)` writes: readers see the old
        file or the complete new one, even across a crash or a Ctrl-C."""
        self.check(name)  # refuse a link now rather than replace it silently
        with sigint_deferred(), self._naming_a_full_disk(name):
            fd, tmp = self._temporary(name)
            try:
                with os.fdopen(fd, "wb") as f:
                    write(f)
                    f.flush()
                    os.fsync(f.fileno())  # the bytes are on disk before the name points at them
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=self.fd)
                raise
            os.fsync(self.fd)  # and the rename itself survives a crash

    def move_to(self, name: str, folder: SafeDir) -> Path:
        """Moves `name` into `folder`, under a name free there (NAME, NAME.1,
        ...): nothing there is replaced. Returns the new path."""
        for k in itertools.count():
            new = name if k == 0 else f"{name}.{k}"
            if not folder.check(new):  # a link there raises: never renamed over
                os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=folder.fd)
                return folder.path / new
        raise AssertionError("unreachable")

    def lock(self, name: str) -> Tuple[Optional[int], str]:
        """An exclusive lock on file `name` (created, never through a link),
        with this process's id written in it: (its fd, held until closed or
        the process ends, even killed), or (None, what the holder wrote) if
        another process holds it."""
        try:
            fd = os.open(
                name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NOFOLLOW, 0o666, dir_fd=self.fd
            )
        except OSError as e:
            raise self._refusal(name, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip()
            os.close(fd)
            return None, holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return fd, ""

    def remove(self, name: str) -> None:
        """Removes `name` (a link is removed, never its target)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    # -------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _naming_a_full_disk(self, name: str) -> Iterator[None]:
        """A full disk raises OSError(ENOSPC) naming the file: the bare
        errno names no file, and torch.save reports it as its zip writer's
        "unexpected pos" (the OSError only in the exception's context)."""
        try:
            yield
        except Exception as e:
            full = _disk_full(e)
            if full is None:
                raise
            raise OSError(
                errno.ENOSPC,
                f"pyddp: disk full: could not write {self.path / name} ({full}); the files "
                "already there are intact and no temporary is left. Free space or choose "
                "another output_dir, then run again (resume=True continues from the last "
                "checkpoint)",
            ) from e

    def _temporary(self, name: str):
        """A new file with an unguessable name next to `name`: nobody can
        place a link there in advance (O_EXCL, O_NOFOLLOW)."""
        while True:
            tmp = f".{name}.{secrets.token_hex(8)}.tmp"
            try:
                return os.open(tmp, _CREATE, 0o666, dir_fd=self.fd), tmp
            except FileExistsError:
                continue

    def _regular(self, fd: int, name: str, mode: str) -> IO[bytes]:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise self._refusal(name)
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)

    def _refusal(self, name: str, error: Optional[OSError] = None) -> OSError:
        """UnsafePathError naming the path and what is there; other errors
        (permissions, a read-only or full disk) as they are, with the whole
        path (the bare error names the file alone)."""
        if error is not None and error.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            return type(error)(error.errno, error.strerror, str(self.path / name))
        try:
            mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except OSError:
            mode = 0
        if stat.S_ISLNK(mode):
            what = "a symbolic link"
        elif stat.S_ISDIR(mode):
            what = "a directory"
        elif stat.S_ISREG(mode):
            what = "a file, not a directory"
        else:
            what = "not a regular file"
        return UnsafePathError(
            errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL,
            f"pyddp: refusing to use {self.path / name}: it is {what}. pyddp never writes "
            "through links or into special files; remove it, or choose another output_dir",
        )
