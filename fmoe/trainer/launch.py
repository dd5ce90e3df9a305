"""One process per rank, as torchrun starts them (or a single process without it).

torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the main job reads them
before anything else so that a plan that does not fit the world is refused before a
process group exists. GPUs use NCCL (rank ``r`` of a node on ``cuda:LOCAL_RANK``),
CPUs gloo.

Under ``python -m fmoe.torchrun`` (which sets ``FMOE_ERRORS_TO_FILE=1``) a worker's
one-line error goes to the error file torchrun gives each worker
(``TORCHELASTIC_ERROR_FILE``) instead of stderr, and fmoe.torchrun prints one of them
once (``exit_with``); elsewhere it is printed, as always.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..checkpoint.files import replace_file


class World(NamedTuple):
    """Where this process stands: ``rank`` of ``size`` processes, ``local_rank`` on its node."""

    rank: int
    size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def world_from_env() -> World:
    """This process's place as torchrun describes it (one process when it does not)."""
    size = _env_int("WORLD_SIZE", 1)
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"RANK={rank} / WORLD_SIZE={size} from the environment are inconsistent")
    return World(rank, size, local)


def rank_device(device: str, world: World) -> str:
    """``cuda`` means this rank's GPU (``cuda:LOCAL_RANK``); anything else is used as given."""
    return f"cuda:{world.local_rank}" if device == "cuda" else device


def start(world: World, device: str, timeout_s: float | None = None) -> None:
    """Create the default process group for a multi-process run (no-op for one process).

    Arguments:
        world: from ``world_from_env``.
        device: the rank's device; ``cuda:*`` selects NCCL, anything else gloo.
        timeout_s: how long a collective may wait for the other ranks before failing
            (None: torch's default).
    """
    if world.size == 1 or dist.is_initialized():
        return
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(torch.device(device))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("nccl" if cuda else "gloo", **kwargs)


# What gloo and NCCL say when a peer is gone or too slow: gloo raises a plain
# RuntimeError ("Connection closed by peer", "Timed out waiting"), NCCL's watchdog a
# DistBackendError.
_PEER_FAILURE = ("connection closed by peer", "connection reset", "timed out", "timeout", "gloo", "nccl")


def is_collective_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another rank died or hung."""
    if hasattr(dist, "DistError") and isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err).lower() for s in _PEER_FAILURE)


def stop() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


ERRORS_TO_FILE = "FMOE_ERRORS_TO_FILE"
"""Set to ``1`` by ``python -m fmoe.torchrun`` for its workers (see the module's docstring)."""


def error_file() -> str | None:
    """Where this worker's one-line error goes instead of stderr: torchrun's error file for
    it when ``python -m fmoe.torchrun`` started it; None (print it) otherwise."""
    if os.environ.get(ERRORS_TO_FILE) != "1":
        return None
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None  # "" where torchrun keeps no logs


def write_error_file(path: str, message: str, consequence: bool = False) -> None:
    """Write ``message`` as torchrun's ``ProcessFailure`` reads an error file (a str
    ``message`` and a ``timestamp``), atomically. ``consequence``: the error follows
    another rank's failure (a collective that failed), so fmoe.torchrun prefers a
    rank's own error to it."""
    data = {"message": message, "timestamp": int(time.time()), "fmoe": {"consequence": consequence}}
    replace_file(path, json.dumps(data))


def exit_with(line: str, consequence: bool = False) -> SystemExit:
    """The SystemExit that ends this process with the one-line error ``line``.

    Returns:
        ``SystemExit(line)`` (Python prints it, exit status 1); under fmoe.torchrun
        ``SystemExit(1)`` with ``line`` written to the error file instead, and printed
        too when torchrun will restart the workers (``--max-restarts`` left): it reads
        the error files only when it gives up, so an attempt it restarts would
        otherwise end without its cause.
    """
    path = error_file()
    if path is None:
        return SystemExit(line)
    write_error_file(path, line, consequence)
    if _env_int("TORCHELASTIC_RESTART_COUNT", 0) < _env_int("TORCHELASTIC_MAX_RESTARTS", 0):
        print(line, file=sys.stderr)
    return SystemExit(1)


def record_unexpected(err: BaseException) -> None:
    """Under fmoe.torchrun, an error with a traceback (which still prints) also leaves
    its type and message in the error file, as torch's ``@record`` does."""
    if error_file() is not None:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)


@contextlib.contextmanager
def parser_errors_to_file():
    """Under fmoe.torchrun, what argparse prints before its SystemExit (a mistyped flag)
    goes to the error file instead of stderr; anything else written to stderr meanwhile
    (warnings) is passed on when the block ends. Elsewhere: nothing changes."""
    path = error_file()
    if path is None:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except SystemExit as err:
        said = held.getvalue().strip()
        if isinstance(err.code, int) and err.code != 0 and said:
            write_error_file(path, said)
        else:
            sys.stderr.write(held.getvalue())
        raise
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
    sys.stderr.write(held.getvalue())
