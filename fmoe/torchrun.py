"""``python -m fmoe.torchrun``: torchrun, ending a Ctrl-C or a SIGTERM in one line.

    python -m fmoe.torchrun --nproc-per-node 8 -m fmoe.train --config qwen3-moe-small

Same flags and behaviour as ``torchrun`` (it runs ``torch.distributed.run``'s own
launcher). The difference is the end of a stopped job: torchrun passes SIGINT or SIGTERM
on to its workers, which agree on a step, save a checkpoint and print one line saying
which (``fmoe.train``); torchrun itself then raises its ``SignalException``, whose
traceback would be the last thing on the screen. Here it is one line instead, and the
exit status is 128 + the signal's number, as a shell reports a process it stopped.

torchrun waits 30 seconds for its workers before killing them; a save cut short by
that leaves the previous checkpoint whole (saves are atomic).
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import get_args_parser, run


def main(argv=None) -> None:
    args = get_args_parser().parse_args(argv)
    try:
        run(args)
    except SignalException as err:
        name = signal.Signals(err.sigval).name
        print(f"fmoe.torchrun: {name}: the workers were asked to stop; their last lines above say what they "
              "saved", file=sys.stderr)
        raise SystemExit(128 + int(err.sigval)) from None


if __name__ == "__main__":
    main()
