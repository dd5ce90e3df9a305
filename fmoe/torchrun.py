"""``python -m fmoe.torchrun``: torchrun, ending a failed or stopped job in one line.

    python -m fmoe.torchrun --nproc-per-node 8 -m fmoe.train --config qwen3-moe-small

Same flags and behaviour as ``torchrun`` (it runs ``torch.distributed.run``'s own
launcher). The difference is the end of a job that did not finish:

- A failed job ends with one line, the error of its lowest failing rank, instead of
  every rank's copy of it followed by torchrun's ``ChildFailedError`` report. The
  workers are told so (``FMOE_ERRORS_TO_FILE=1``): ``fmoe.train`` then writes its one-line
  error into the error file torchrun gives each worker instead of printing it
  (``fmoe.trainer.launch``), and this reads them back from torchrun's per-rank
  failures. A rank's own error is preferred to a failed collective (which follows
  another rank's death), and either to a rank that torchrun stopped. A worker that died
  without a message (a segfault, the OOM killer) gets a line naming its rank, its exit
  code or signal and where its output is. The exit status is the worker's (1 when it
  died by a signal). torchrun's own log lines (its ``W``/``E`` records) are left as
  they are.
- A stopped job: torchrun passes SIGINT or SIGTERM on to its workers, which agree on a
  step, save a checkpoint and print one line saying which (``fmoe.train``); torchrun
  itself then raises its ``SignalException``, whose traceback would be the last thing
  on the screen. Here it is one line instead, and the exit status is 128 + the
  signal's number, as a shell reports a process it stopped. torchrun waits 30 seconds
  for its workers before killing them; a save cut short by that leaves the previous
  checkpoint whole (saves are atomic).
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import tempfile
import time

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from .trainer.launch import ERRORS_TO_FILE


def _message(failure: ProcessFailure) -> str | None:
    """The error the worker wrote, or None: fmoe.train's line, or the type and message
    of an exception torch's error handler recorded (its traceback printed above)."""
    data = failure.error_file_data
    if not isinstance(data, dict) or failure.error_file == "<N/A>":
        return None
    message = data.get("message")
    if isinstance(message, dict):  # torch's ErrorHandler: {"message": "Type: text", "extraInfo": ...}
        message = message.get("message")
    return message.strip() if isinstance(message, str) and message.strip() else None


def _cause_rank(rank: int, failure: ProcessFailure) -> tuple:
    """Sort key: the likeliest cause first, then the lowest rank. A message of the
    rank's own; a failed collective's (another rank failed first); a death without a
    message (a crash); last, a SIGTERM without one (torchrun stopping the survivors).
    Among messages, a rank that exited by itself comes before one that torchrun
    stopped after it wrote its message, whose exit status is not the error's."""
    if _message(failure) is not None:
        consequence = bool(failure.error_file_data.get("fmoe", {}).get("consequence"))
        return (1 if consequence else 0, failure.exitcode <= 0, rank)
    return (3 if failure.exitcode == -signal.SIGTERM else 2, False, rank)


def reported_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The ``(global rank, failure)`` that a failed job's one line is about."""
    return min(err.failures.items(), key=lambda item: _cause_rank(*item))


def output_place(failure: ProcessFailure, args, since: float) -> str:
    """Where the worker's output is: its ``stderr.log`` when torchrun redirected it
    (``--redirects`` / ``--tee``, under ``--log-dir`` or torchrun's temporary folder),
    else the console above. ``since``: when the job started (older logs are another job's)."""
    if args.redirects == "0" and args.tee == "0":
        return "its output is above"
    roots = [args.log_dir] if args.log_dir else glob.glob(os.path.join(tempfile.gettempdir(), "torchelastic_*"))
    found = [p for root in roots for p in glob.glob(os.path.join(root, "*", "attempt_*", str(failure.local_rank),
                                                                 "stderr.log"))
             if os.path.getmtime(p) >= since]
    return f"its output is in {max(found, key=os.path.getmtime)}" if found else "its output is above"


def describe(rank: int, failure: ProcessFailure, output: str = "its output is above") -> str:
    """The one line for a failed job: the worker's own, or what is known of its death.

    Arguments:
        rank, failure: from ``reported_failure``.
        output: where the worker's output is (``output_place``), for a worker that
            died without a message.
    """
    message = _message(failure)
    if message is not None:
        return message
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else
           f"exited with code {failure.exitcode}")
    return (f"fmoe.torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) {how} without an "
            f"error message; {output}")


def exit_status(failure: ProcessFailure) -> int:
    """The worker's exit code, or 1 for a worker that died by a signal."""
    return failure.exitcode if failure.exitcode > 0 else 1


def main(argv=None) -> None:
    args = get_args_parser().parse_args(argv)
    started, before = time.time(), os.environ.get(ERRORS_TO_FILE)
    os.environ[ERRORS_TO_FILE] = "1"  # the workers inherit it: their one-line errors go to their error files
    try:
        run(args)
    except SignalException as err:
        name = signal.Signals(err.sigval).name
        print(f"fmoe.torchrun: {name}: the workers were asked to stop; their last lines above say what they "
              "saved", file=sys.stderr)
        raise SystemExit(128 + int(err.sigval)) from None
    except ChildFailedError as err:
        rank, failure = reported_failure(err)
        print(describe(rank, failure, output_place(failure, args, started)), file=sys.stderr)
        raise SystemExit(exit_status(failure)) from None
    finally:
        if before is None:
            os.environ.pop(ERRORS_TO_FILE, None)
        else:
            os.environ[ERRORS_TO_FILE] = before


if __name__ == "__main__":
    main()
