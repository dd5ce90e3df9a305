"""A planned run as the main job's command line: ``torchrun ... -m fmoe.train`` with a flag
for each ModelConfig and Plan field (and ``--batch``, ``--seq``, ``--moments``) whose value
differs from the main job's default, so ``fmoe.trainer.options.resolve`` of those flags
builds the plan again."""

from __future__ import annotations

import shlex

from ..config import Plan
from ..trainer import options

RUN_KEYS = ("batch", "seq", "moments")  # the run settings a plan's step depends on


def _setting(name: str, value):
    """A ModelConfig or Plan field's value as the main job's settings hold it."""
    if name in options.LAYER_LISTS:
        return ",".join(map(str, value))
    if name in options.MEMBER_GROUPS:
        return ",".join("+".join(group) for group in value) if value else ""
    return value


def _flag(name: str, value, kind: type) -> list[str]:
    if kind is bool:
        return [options.flag(name) if value else "--no-" + options.flag(name)[2:]]
    return [options.flag(name), shlex.quote(repr(value) if isinstance(value, float) else str(value))]


def train_flags(plan: Plan, run: dict, vocab_from_data: bool = False, config: str = "") -> list[str]:
    """The ``fmoe.train`` flags that run ``plan``.

    Arguments:
        plan: the planned Plan.
        run: ``batch``, ``seq`` and ``moments`` of the planned run.
        vocab_from_data: leave ``--vocab`` out (the main job takes the data's).
        config: the ``--config`` the plan started from ("" for none): its settings are
            the defaults the flags change, and it comes first.

    Returns:
        The flags: ``--config`` if given, then each value that differs from the main
        job's default, in ``--help``'s order (model fields, plan fields, the run's).
    """
    defaults, _ = options.resolve(["--config", config] if config else [])
    wanted = {name: _setting(name, getattr(plan.model, name)) for name in options.MODEL_FIELDS}
    wanted.update({name: _setting(name, getattr(plan, name)) for name in options.PLAN_FIELDS})
    wanted.update({name: run[name] for name in RUN_KEYS})
    if vocab_from_data:
        del wanted["vocab"]
    flags = ["--config", shlex.quote(config)] if config else []
    for name, value in wanted.items():
        if value != defaults[name]:
            flags += _flag(name, value, options.KNOWN[name])
    return flags


def launcher(gpus: int, gpus_per_node: int) -> str:
    """The command that starts ``gpus`` processes: ``python`` for one, ``torchrun`` on one
    node, ``torchrun`` with a rendezvous over several (run on each node)."""
    if gpus == 1:
        return "python"
    if gpus <= gpus_per_node:
        return f"torchrun --nproc-per-node {gpus}"
    nodes = -(-gpus // gpus_per_node)
    if gpus % nodes:  # torchrun starts the same number of processes on every node
        return f"(torchrun cannot split {gpus} processes evenly over {nodes} nodes of {gpus_per_node} GPUs)"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {gpus // nodes} --rdzv-backend c10d "
            "--rdzv-endpoint HOST:29500")


def run_line(plan: Plan, run: dict, gpus_per_node: int, vocab_from_data: bool = False, config: str = "") -> str:
    """``run it: <launcher> -m fmoe.train <flags>`` for ``plan`` (``train_flags``)."""
    flags = " ".join(train_flags(plan, run, vocab_from_data, config))
    note = " (the vocabulary from --data)" if vocab_from_data else ""
    return f"run it: {launcher(plan.world, gpus_per_node)} -m fmoe.train {flags}{note}"
