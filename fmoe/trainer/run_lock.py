"""One live run per folder: the main job's lock on ``--out``.

The main job (rank 0 under torchrun) holds an exclusive lock on ``<out>/.fmoe-lock``
from before it reads the folder until it exits, so a second job launched into the same
folder (a duplicated scheduler job, the same command typed twice) is refused before it
reads or writes anything there, with one line naming the holder.

The lock is the operating system's (``flock``): the kernel drops it with the process,
so a killed run leaves nothing to clean up. Where the filesystem has no ``flock`` (some
network filesystems answer ENOLCK or EOPNOTSUPP) the file itself is the lock: created
exclusively, naming host, pid and the process's start time, and taken over only when
that process is gone. A holder on another host cannot be checked from here; the message
says which file to remove if that run is gone.

In both modes the file names its holder (host, pid, start, arguments, mode) for that
message. A flock is only as wide as the filesystem makes it: NFS mounted with
``local_lock=flock`` and Lustre with ``localflock`` grant it per host, so there two hosts
can both take it.

Only the main rank takes the lock; the other ranks of a run read the folder (a resume)
but write nothing there before their first collective with it, so a refused job's
other ranks end with it.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # not POSIX: only the lock file
    fcntl = None

LOCK_NAME = ".fmoe-lock"
# what flock answers on a filesystem that does not support it
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


class FolderInUse(ValueError):
    """``--out`` is held by another live run."""


class RunLock(NamedTuple):
    """A held lock: its file, the ``flock``'d descriptor (None for a lock file alone),
    what it says of this process, and the folders it made (removed on release if empty)."""

    path: Path
    fd: int | None
    holder: dict
    made: tuple[Path, ...]


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), to tell a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 else None


def _this_process(mode: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": shlex.join(sys.argv[1:]), "mode": mode}


def _same_process(a: dict | None, b: dict) -> bool:
    return a is not None and all(a.get(k) == b.get(k) for k in ("host", "pid", "start_ticks"))


def _read_holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a run that has not recorded itself yet"
    args = f", args: {holder['args']}" if holder.get("args") else ""
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (started {holder.get('started', '?')}{args})"


def _is_gone(holder: dict) -> bool:
    """Whether the holder's process has certainly ended: on this host only."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    ticks = _start_ticks(holder["pid"])
    return ticks is not None and holder.get("start_ticks") is not None and ticks != holder["start_ticks"]


def _in_use(out: Path, holder: dict | None, by_file: bool) -> FolderInUse:
    hint = "wait for it to end or name another --out"
    if by_file:
        hint += f" (if that run is gone, remove {out / LOCK_NAME})"
    return FolderInUse(f"--out={str(out)!r} is in use by a live run: {_describe(holder)}; {hint}")


def _make_folder(out: Path) -> tuple[Path, ...]:
    missing = []
    at = out
    while not at.exists():
        missing.append(at)
        at = at.parent
    out.mkdir(parents=True, exist_ok=True)
    return tuple(missing)  # deepest first


def _open_or_create(path: Path) -> tuple[int, bool]:
    try:
        return os.open(path, os.O_RDWR), False
    except FileNotFoundError:
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:  # another run made it meanwhile
        return os.open(path, os.O_RDWR), False


def _flock(path: Path, out: Path, me: dict) -> int | None:
    """The locked descriptor, or None where the filesystem has no flock."""
    while True:
        fd, created = _open_or_create(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(out, _read_holder(path), by_file=False) from None
        except OSError as err:
            os.close(fd)
            if created:  # the lock file of the fallback is made exclusively, by its holder
                path.unlink()
            if err.errno in _NO_FLOCK:
                return None
            raise
        try:  # a holder that released unlinked the file we opened: lock the path's new file
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            holder = _read_holder(path)
            if holder is not None and holder.get("mode") == "file" and not _is_gone(holder):
                os.close(fd)  # a live run that found no flock holds the file itself
                raise _in_use(out, holder, by_file=True)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            return fd
        os.close(fd)


def _remove_stale(path: Path, inode: int, out: Path) -> None:
    """Move the stale lock file (the one with ``inode``) away. Of several takers one
    moves it; one that finds it moved a newer file instead (another taker's, live)
    puts that back and is refused."""
    stale = path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
    try:
        os.rename(path, stale)
    except FileNotFoundError:
        return
    if os.stat(stale).st_ino != inode:
        try:
            os.link(stale, path)
        finally:
            os.unlink(stale)
        raise _in_use(out, _read_holder(path), by_file=True)
    os.unlink(stale)


def _lock_file(path: Path, out: Path, me: dict) -> None:
    """Create ``path`` exclusively, taking it over from a holder that is gone."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                inode = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            holder = _read_holder(path)
            if holder is None or not _is_gone(holder):
                raise _in_use(out, holder, by_file=True) from None
            _remove_stale(path, inode, out)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        return
    raise _in_use(out, _read_holder(path), by_file=True)


def acquire(out) -> RunLock:
    """Take ``out``'s lock (making the folder if needed).

    Raises:
        FolderInUse (a ValueError): another live run holds it; the message names it.
    """
    out = Path(out)
    path = out / LOCK_NAME
    try:
        made = _make_folder(out)
    except OSError as err:
        raise ValueError(f"--out={str(out)!r}: cannot make the folder ({err.strerror or err})") from None
    try:
        me = _this_process("flock")
        fd = _flock(path, out, me) if fcntl is not None else None
        if fd is None:
            me = _this_process("file")
            _lock_file(path, out, me)
    except FolderInUse:
        _remove_empty(made)
        raise
    except OSError as err:
        _remove_empty(made)
        raise ValueError(f"--out={str(out)!r}: cannot take the run folder's lock {str(path)!r} "
                         f"({err.strerror or err}); allowed: a folder this user can write") from None
    except BaseException:
        _remove_empty(made)
        raise
    return RunLock(path, fd, me, made)


def _remove_empty(folders) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # holds something: a run's files
            return


def release(lock: RunLock | None) -> None:
    """Give the lock up: its file removed (a lock file only if it still names this
    process), the folders it made removed if they hold nothing else."""
    if lock is None:
        return
    if lock.fd is not None or _same_process(_read_holder(lock.path), lock.holder):
        try:
            lock.path.unlink()
        except FileNotFoundError:
            pass
    if lock.fd is not None:
        os.close(lock.fd)  # after the unlink: a waiting run then finds the path free
    _remove_empty(lock.made)


__all__ = ["FolderInUse", "LOCK_NAME", "RunLock", "acquire", "release"]
