"""The main job: train an MoE LM, from a laptop to many GPUs, with one command.

    python -m fmoe.train                                   # CPU, a few minutes, embedded corpus
    torchrun --nproc-per-node 2 -m fmoe.train --sharding optim_grads_params
    torchrun --nproc-per-node 8 -m fmoe.train --config qwen3-moe-small --data data/mycorpus
    python -m fmoe.train --config run.toml --print-config  # the merged settings, as TOML

Every ModelConfig and Plan field is a flag named after it (``--kv-heads``, ``--ep``,
``--delay-wgrad`` ...), as is every run option; ``--config`` reads them from a TOML
file (``kv_heads = 4``) or a shipped preset, flags overriding it. One process per
rank: torchrun's environment says how many; each rank reads its own rows of every
batch. Data: the embedded corpus (Python's documentation, bytes), or ``--data`` a
directory written by ``python -m fmoe.data prepare``. ``--init-from-hf`` starts from
a Hugging Face checkpoint. Writes ``metrics.jsonl`` (and TensorBoard events when
``tensorboard`` is installed), ``settings.toml`` and the checkpoint under ``--out``;
``--resume`` continues from it, bit for bit. Ends with a sample of generated text.
One live run per ``--out``: the job holds a lock on the folder for its whole life, and a
second job into a held folder is refused, naming the holder.
CUDA graphs (``--cuda-graph``) and TransformerEngine experts (``--expert-backend te``)
come from the adapters: ``python -m interop.train`` takes the same flags and adds them.
"""

from __future__ import annotations

import os
import sys

from .plan.budget import device_warning
from .trainer import launch, loop, run_lock, setup


def parse_args(argv=None, adapters: setup.Adapters | None = None, lock: bool = False) -> setup.Run:
    """The checked run for these arguments (SystemExit naming a bad setting); its
    ``plan`` is what ``fmoe.load`` of the run's checkpoints needs. ``lock``: hold the
    run folder's lock in ``run.lock`` (``main`` does; release it with
    ``fmoe.trainer.run_lock.release``). Under ``python -m fmoe.torchrun`` the error
    goes to the worker's error file instead of stderr (``fmoe.trainer.launch.exit_with``),
    and fmoe.torchrun prints it once."""
    try:
        with launch.parser_errors_to_file():  # a mistyped flag: argparse's lines
            run = setup.prepare(argv, adapters, lock)
    except ValueError as err:
        raise launch.exit_with(f"fmoe.train: {err}") from None
    if isinstance(run, str):  # --print-config
        print(run, end="")
        raise SystemExit(0)
    return run


def _warn_if_full(run: setup.Run) -> None:
    """On CUDA, before a parameter is drawn: the line for a plan whose estimate leaves the
    GPU less than the planner's reserve (the main rank works it out and says it)."""
    if run.world.is_main:
        s = run.settings
        full = device_warning(run.plan, s.batch, s.seq, s.moments)
        if full:
            run.say(full)


def _interrupted(what: str) -> int:
    print(f"fmoe.train: interrupted (Ctrl-C) {what}", file=sys.stderr)
    return 130


def main(argv=None, adapters: setup.Adapters | None = None) -> dict:
    """Run the main job; returns its summary (losses, throughput, checkpoint path).

    ``adapters`` (``python -m interop.train`` hands them in) enable ``--cuda-graph``
    and ``--expert-backend te``.

    A ValueError or OSError raised after setup (a truncated checkpoint, a missing
    file, a held-out split shorter than a batch, an unwritable folder) ends the job
    with one line naming it and a non-zero exit; ``FMOE_DEBUG=1`` re-raises it with its
    traceback. A collective that fails (another rank died, or did not answer within
    ``--timeout``) ends this rank with an error naming it, instead of a hang: torchrun then stops the
    others, and ``--max-restarts`` with ``--resume`` picks the run up again.

    Under ``python -m fmoe.torchrun`` these one-line errors go to torchrun's error file
    for the worker instead of stderr, and fmoe.torchrun prints the one of the lowest
    failing rank (a rank's own error before a failed collective, which follows another's).
    """
    try:
        run = parse_args(argv, adapters, lock=True)
    except KeyboardInterrupt:
        raise SystemExit(_interrupted("before the first step: nothing was written")) from None
    except Exception as err:  # not a bad setting (parse_args says those in one line): a traceback
        launch.record_unexpected(err)
        raise
    try:
        launch.start(run.world, run.plan.device, run.settings.timeout)
        _warn_if_full(run)
        return loop.train(run)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop catches signals
        latest = run.out / "checkpoint"
        saved = f"the last checkpoint is {latest.resolve()}" if latest.exists() else "no checkpoint was saved"
        raise SystemExit(_interrupted(f"stopped at once, without saving; {saved}")) from None
    except SystemExit as err:  # the loop's own one-line stops (cannot resume, non-finite steps)
        if isinstance(err.code, str):
            raise launch.exit_with(err.code) from None
        raise
    except Exception as err:
        if run.world.size > 1 and launch.is_collective_failure(err):
            raise launch.exit_with(f"fmoe.train: rank {run.world.rank} of {run.world.size}: a collective failed "
                                   f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                                   "another rank has probably died or hung. The last checkpoint is "
                                   f"{run.out / 'checkpoint'}; restart with --resume", consequence=True) from None
        if not isinstance(err, (ValueError, OSError)) or os.environ.get("FMOE_DEBUG") == "1":
            launch.record_unexpected(err)
            raise
        # a file, setting or datum found wrong after setup: one line, not a traceback
        where = f"rank {run.world.rank} of {run.world.size}: " if run.world.size > 1 else ""
        raise launch.exit_with(f"fmoe.train: {where}{type(err).__name__}: {err} (FMOE_DEBUG=1 shows the "
                               "traceback)") from None
    finally:
        try:
            launch.stop()
        finally:
            run_lock.release(run.lock)


if __name__ == "__main__":
    main()
