"""Where ``python -m fmoe.hf export`` writes: the checks on ``--out``, and the
all-at-once replacement.

The export fills a temporary sibling of ``--out`` and takes its place only once
complete: where the system has it (Linux ``renameat2`` with ``RENAME_EXCHANGE``) the
old folder and the new one swap names in one step and the old one is removed after;
elsewhere the old folder is moved aside, the new one renamed into place, and the old
one removed last. A failure or Ctrl-C before that leaves ``--out`` as it was and no
temporary folder (nor any parent folder made for it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Iterator

from ..checkpoint.files import swap_into_place

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _holds(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def check_out(out: Path, overwrite: bool, kept: dict, marker: str = "config.json") -> Path:
    """The folder the export replaces for ``--out``: ``out`` (a link's target, if a link).

    Arguments:
        out: the ``--out`` path.
        overwrite: whether an existing Hugging Face model folder may be replaced.
        kept: ``{what, for messages: folder}`` that ``out`` may never be or hold (the
            source, the checkpoint), compared resolved.
        marker: the file that makes a folder one the export may replace (a Hugging Face
            model's ``config.json``, a PEFT adapter's ``adapter_config.json``).

    Returns:
        The path to write.

    Raises:
        ValueError: one line naming ``--out`` (and ``--overwrite`` where it would help).
    """
    resolved = out.resolve()
    for what, folder in kept.items():
        if folder is not None and _holds(resolved, folder.resolve()):
            raise ValueError(f"--out {out} is or holds {what}, which the export reads and would destroy: "
                             "choose another --out (--overwrite does not apply)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--out {out} exists and is not empty; pass --overwrite to replace it (the old folder "
                             "stays whole until the new one is complete)")
        if not (out / marker).is_file():
            kind = "Hugging Face model" if marker == "config.json" else "PEFT adapter"
            raise ValueError(f"--out {out} holds no {marker}, so it is no {kind} folder; refusing to replace it, "
                             "even with --overwrite")
    return resolved if out.is_symlink() else out


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of ``path`` that do not exist yet, deepest first."""
    missing, parent = [], path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


@contextlib.contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """A path beside ``out`` for the export to create and fill; when the block ends
    normally, the folder there replaces ``out``, otherwise it is removed.

    Arguments:
        out: the folder to write (``check_out``'s answer).

    Yields:
        The temporary path (not created: ``fmoe.hf.save`` makes it).
    """
    made = _missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    published = False
    try:
        yield stage
        _publish(stage, out)
        published = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not published:
            for parent in made:
                with contextlib.suppress(OSError):  # not empty: something else is there now
                    parent.rmdir()


def _publish(stage: Path, out: Path) -> None:
    """``stage`` (complete) in place of ``out``; the old ``out`` removed."""
    with _interrupts_deferred():
        if not out.exists() or (out.is_dir() and not any(out.iterdir())):
            os.rename(stage, out)  # over an empty folder too, in one step
            return
        if _exchange(stage, out):
            shutil.rmtree(stage)  # the old folder, now under the temporary name
            return
        swap_into_place(stage, out)  # two renames: the old folder moved aside, removed last


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` in one step (Linux ``renameat2``,
    ``RENAME_EXCHANGE``); False where the system or file system has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C ignored while the complete export takes ``--out``'s place, so that it
    cannot stop a swap halfway; the export is whole by then, so nothing is left to stop."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield  # only the main thread may set handlers; one set outside Python is left alone
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
