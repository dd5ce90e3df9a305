"""The checkpoint directory on disk: atomic replacement, integrity checks."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..comm.collectives import Group, broadcast_text, gather_texts

META_FILE = "fmoe.json"


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def io_threads() -> int:
    """Threads a rank writes and hashes its checkpoint files on: its share of the cores
    (``torch.get_num_threads``, which the main job sets per rank), at most 8."""
    return max(1, min(8, torch.get_num_threads()))


def data_files(directory: Path) -> list[str]:
    """The names of the data files DCP wrote into ``directory``, sorted."""
    return sorted(p.name for p in directory.iterdir() if p.suffix == ".distcp")


def checksums(directory: Path, names=None) -> dict:
    """``{file name: sha256}`` of ``names`` in ``directory`` (default: every data file),
    several files at once (hashlib lets go of the GIL while it hashes)."""
    names = data_files(directory) if names is None else list(names)
    with ThreadPoolExecutor(io_threads()) as pool:
        return dict(zip(names, pool.map(lambda name: digest(directory / name), names)))


def gathered_checksums(directory: Path, world: Group, device) -> dict:
    """``checksums`` of every data file a collective save wrote into ``directory``, each
    rank hashing its own (DCP names rank ``r``'s ``__r_<n>.distcp``), on every rank; a
    file no rank claims is hashed by rank 0, so none is left out."""
    names = data_files(directory)
    mine = [n for n in names if n.startswith(f"__{world.rank}_")]
    if world.rank == 0:
        mine += [n for n in names if not any(n.startswith(f"__{r}_") for r in range(world.size))]
    try:
        text = json.dumps({"sums": checksums(directory, mine)})
    except OSError as err:  # told to every rank below: none waits on a rank that gave up
        text = json.dumps({"error": f"rank {world.rank} could not read its files back: {err}"})
    sums: dict = {}
    for part in map(json.loads, gather_texts(text, world, device)):
        if "error" in part:
            raise OSError(part["error"])
        sums.update(part["sums"])
    return sums


def write_atomically(text: str, path: Path) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path, text: str) -> None:
    """``path`` holds ``text``, or what it held before, never a part of either: a
    temporary sibling written, synced and renamed over it (removed if the write fails)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def chmod_as_umask(path: Path) -> None:
    """Give the file ``path`` the mode ``open`` gives a new file under the process's umask
    (0644 under the usual 022): writers that go through a private temporary file
    (``tempfile.mkstemp``'s 0600, as safetensors' ``save_file`` does) leave it readable by
    its owner alone."""
    umask = os.umask(0o022)  # the only way to read it; set back at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def swap_into_place(tmp: Path, path: Path) -> None:
    """Replace ``path`` by the complete directory ``tmp``; the old one is removed last.

    A crash between the two renames leaves the old checkpoint as ``.<name>.old-*``,
    which ``resolve`` finds.
    """
    old = path.parent / f".{path.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
    if path.exists():
        os.rename(path, old)
    os.rename(tmp, path)
    for stale in path.parent.glob(f".{path.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


def checkpoint_dir(path: Path) -> Path:
    """The checkpoint directory to read for ``path`` (recovering an interrupted swap,
    of ``path`` or of the directory a link at ``path`` points to)."""
    if path.is_symlink():
        path = path.resolve()
    if (path / META_FILE).exists():
        return path
    olds = [p for p in path.parent.glob(f".{path.name}.old-*") if (p / META_FILE).exists()]
    if not path.exists() and olds:
        return max(olds, key=lambda p: p.stat().st_mtime)
    raise FileNotFoundError(f"no fmoe checkpoint at {path} ({META_FILE} missing)")


def check_files(directory: Path, storage: list, sums: dict | None, world: Group | None = None, device="cpu") -> None:
    """Raise ValueError naming the file and a key it holds if data is missing,
    truncated or (with ``sums``) altered. Under ``world`` (a collective load) each rank
    hashes a share of the files and every rank raises the first error any found: no rank
    leaves before the others hear what it found."""
    try:
        error = _file_error(directory, storage, sums, world)
    except OSError as err:  # a file this rank could not read back
        error = f"{directory}: a data file could not be read ({err})"
    found = [error] if world is None else gather_texts(error, world, device)
    first = next((e for e in found if e), None)
    if first:
        raise ValueError(first)


def _file_error(directory: Path, storage: list, sums: dict | None, world: Group | None) -> str:
    """``check_files``' first finding on this rank, or ""."""
    holds: dict = {}
    for entry in storage:
        holds.setdefault(entry["file"], []).append(entry["fqn"])
        f = directory / entry["file"]
        if not f.exists():
            return f"{directory}: data file {entry['file']} holding {entry['fqn']!r} is missing"
        if f.stat().st_size < entry["start"] + entry["length"]:
            return (f"{directory}: data file {entry['file']} is truncated ({f.stat().st_size} bytes); "
                    f"{entry['fqn']!r} needs bytes up to {entry['start'] + entry['length']}")
    names = sorted(sums or {})
    share = names if world is None else names[world.rank::world.size]
    for name, got in checksums(directory, share).items():
        if got != sums[name]:
            keys = sorted(set(holds.get(name, [])))
            return (f"{directory}: data file {name} is corrupted (checksum mismatch); it holds "
                    f"{keys[:4]}{' ...' if len(keys) > 4 else ''}")
    return ""


@contextlib.contextmanager
def staged_directory(path: Path, world: Group, device, what: str) -> Iterator[tuple[Path, Callable]]:
    """A temporary sibling of ``path``, named alike on every rank, for a collective save
    to fill; removed by rank 0 whatever happens.

    Yields ``(tmp, publish)``. ``publish(finish)`` is collective: rank 0 calls
    ``finish()`` (the last files, written into ``tmp``) and swaps ``tmp`` into place; a
    failure there is raised as an OSError naming ``what`` on every rank, so no rank
    goes on as if the save had happened.
    """
    tmp = path.parent / broadcast_text(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}", world, device)

    def publish(finish: Callable[[], None]) -> None:
        error = None
        if world.rank == 0:
            try:
                finish()
                swap_into_place(tmp, path)
            except Exception as err:  # reported to every rank below
                error = f"{type(err).__name__}: {err}"
        error = broadcast_text(error, world, device)
        if error:
            raise OSError(f"{what} to {path} failed on rank 0: {error}")

    try:
        yield tmp, publish
    finally:
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
