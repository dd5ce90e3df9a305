"""What the planner charges for each action: compute from FLOPs, communication by an
alpha-beta model of the links.

Compute: a node's forward FLOPs on one rank (its matrices' ``2 x params`` per token,
the experts' ``topk`` of them, attention's scores over the keys a query sees), divided
by the GPU's peak and the node kind's efficiency; backward twice the forward (its
dgrad and wgrad; with delayed wgrad half in ``Wgrad``). ``dispatch`` and ``combine``
(routing, the permutation of the rows and their weighting) are bound by memory: the
bytes of the rows they move (``tokens x topk x dim``) at a calibrated speed, each way.
The host's time issuing each node run (calibrated per kind and phase) runs on a clock
of its own (``simulate``): the GPU cannot start a node before it is issued, so an eager
host behind the GPU on small microbatches idles it. The efficiencies come from a
``Calibration``: ``benchmarks/plan_calibration.py`` measures them on the GPU at hand
and writes the JSON file ``--calibration`` reads; without one, the defaults below,
which are assumptions, not measurements.

Communication: ``alpha + bytes_on_the_wire / bandwidth``, the bandwidth a link's: inside
a node (NVLink) when every rank of the group is on one node (``gpus_per_node``
consecutive ranks), else the network's. Per collective of ``N`` bytes over ``g`` ranks:
all-gather and reduce-scatter move ``(g - 1) / g x N``, all-reduce twice that,
all-to-all ``(g - 1) / g`` of what a rank sends, a point-to-point send ``N``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..checks import is_number
from ..params import param_table

DEFAULT_EFFICIENCY = {"attn": 0.45, "experts": 0.55, "dense": 0.55, "head": 0.6, "embed": 0.6}
DEFAULT_MOVE_GBPS = {"dispatch": 1000.0, "combine": 1000.0}
MOVES = (*DEFAULT_MOVE_GBPS, "land")


@dataclass(frozen=True)
class Calibration:
    """Per node kind, the fraction of ``peak_tflops`` its kernels reach.

    Attributes:
        peak_tflops: the GPU's dense bf16 peak (789: H100 / H200 SXM).
        efficiency: ``{kind: fraction}`` for ``attn``, ``experts``, ``dense``, ``head``, ``embed``.
        source: where the numbers come from (a device and date, or "defaults").
        hbm_gbps: GB/s the memory-bound passes over the parameters reach (the step's
            copy of them into its shards, the fused AdamW update; H100's 3.35 TB/s,
            about 90% of it).
        move_gbps: ``{kind: GB/s}`` of ``dispatch``, ``combine`` and ``land`` (the
            combine's unpermute and sum into the stream): the bytes of the rows they
            permute over their time, each way. ``land`` costs nothing unless calibrated.
        host_us: ``{"<phase> <kind>": microseconds}`` the host spends issuing a node run
            (``"forward attn"``, ``"backward experts"``...). Missing: no host time.
    """

    peak_tflops: float = 789.0
    efficiency: dict = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    source: str = "defaults (assumed, not measured)"
    hbm_gbps: float = 3000.0
    move_gbps: dict = field(default_factory=lambda: dict(DEFAULT_MOVE_GBPS))
    host_us: dict = field(default_factory=dict)

    @classmethod
    def read(cls, path, where: str | None = None) -> "Calibration":
        """A calibration file (``benchmarks/plan_calibration.py`` writes one); ``where``:
        how errors name it (default ``calibration <path>``).

        Raises:
            ValueError: naming the file, for one missing, unreadable or not a calibration
                (not a JSON object, an unknown node kind, a number that is not one > 0).
        """
        where = where or f"calibration {path}"
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"{where}: no such file (benchmarks/plan_calibration.py writes one)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{where}: unreadable ({err})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a JSON object of calibration keys")
        for key, allowed in (("efficiency", DEFAULT_EFFICIENCY), ("move_gbps", MOVES), ("host_us", None)):
            table = data.get(key, {})
            if not isinstance(table, dict):
                raise ValueError(f"{where}: {key} must be an object of numbers by node kind")
            unknown = set(table) - set(allowed) if allowed is not None else set()
            if unknown:
                raise ValueError(f"{where}: {key} has unknown node kinds {sorted(unknown)}; allowed: "
                                 f"{', '.join(allowed)}")
            for kind, value in table.items():
                _check_number(where, f"{key}.{kind}", value, zero=key == "host_us")
        for key in ("peak_tflops", "hbm_gbps"):
            if key in data:
                _check_number(where, key, data[key])
        return cls(float(data.get("peak_tflops", 789.0)), {**DEFAULT_EFFICIENCY, **data.get("efficiency", {})},
                   str(data.get("source", path)), float(data.get("hbm_gbps", 3000.0)),
                   {**DEFAULT_MOVE_GBPS, **data.get("move_gbps", {})}, dict(data.get("host_us", {})))


def _check_number(where: str, key: str, value, zero: bool = False) -> None:
    if not (is_number(value) and math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{where}: {key}={value!r} is invalid: must be a finite number "
                         f"{'>= 0' if zero else '> 0'}")


@dataclass(frozen=True)
class Links:
    """The alpha-beta model of the links between GPUs (defaults: H100 / H200 SXM nodes of
    8 GPUs on NVLink 4, one 400 Gb/s InfiniBand NIC per GPU between nodes).

    Attributes:
        gpus_per_node: ranks ``k * gpus_per_node ..`` share a node.
        nvlink_gbps: GB/s a GPU moves in NCCL collectives inside a node (NVLink 4's
            450 GB/s per direction, of which NCCL reaches about 80%).
        network_gbps: GB/s per GPU between nodes (400 Gb/s = 50 GB/s, about 90% reached).
        nvlink_us, network_us: the fixed cost of one collective or send (latency).
    """

    gpus_per_node: int = 8
    nvlink_gbps: float = 360.0
    network_gbps: float = 45.0
    nvlink_us: float = 10.0
    network_us: float = 25.0

    def seconds(self, kind: str, nbytes: float, ranks: tuple) -> float:
        """Seconds of collective ``kind`` (``all_gather``, ``reduce_scatter``,
        ``all_reduce``, ``all_to_all``, ``send``) of ``nbytes`` over world ``ranks``."""
        g = len(ranks)
        if g <= 1 or nbytes <= 0:
            return 0.0
        inside = len({r // self.gpus_per_node for r in ranks}) == 1
        gbps, us = (self.nvlink_gbps, self.nvlink_us) if inside else (self.network_gbps, self.network_us)
        share = {"all_gather": (g - 1) / g, "reduce_scatter": (g - 1) / g, "all_reduce": 2 * (g - 1) / g,
                 "all_to_all": (g - 1) / g, "send": 1.0}[kind]
        return us * 1e-6 + share * nbytes / (gbps * 1e9)


@functools.lru_cache(maxsize=4096)
def _matrix_elements(cfg, kind: str, layer: int | None) -> int:
    """Elements of the matrices node ``kind`` of ``layer`` multiplies by."""
    return sum(math.prod(leaf.shape) for leaf in param_table(cfg).leaves
               if leaf.layer == layer and len(leaf.shape) >= 2 and leaf.node == kind)


def node_flops(cfg, kind: str, layer: int | None, tokens: float, seq: int) -> float:
    """Forward FLOPs of node ``kind`` of ``layer`` for ``tokens`` tokens of sequences of
    ``seq`` positions (the whole node, before any tensor parallelism divides it)."""
    if kind == "experts":
        return 2.0 * tokens * cfg.topk * _matrix_elements(cfg, kind, layer) / cfg.experts
    if kind == "embed":
        return 0.0
    flops = 2.0 * tokens * _matrix_elements(cfg, kind, layer)
    if kind in ("attn", "dense"):  # the scores and their values over the keys a query sees
        window = cfg.layer_window(layer)
        keys = seq / 2 if not window or window >= seq else window - window * window / (2 * seq)
        flops += 2.0 * tokens * cfg.heads * (cfg.head_dim + cfg.v_head_dim) * keys
    return flops


@dataclass(frozen=True)
class CostModel:
    """Calibration and links together: what one action costs a rank."""

    calibration: Calibration = field(default_factory=Calibration)
    links: Links = field(default_factory=Links)

    def compute_seconds(self, flops: float, kind: str) -> float:
        return flops / (self.calibration.peak_tflops * 1e12 * self.calibration.efficiency.get(kind, 0.5))

    def host_seconds(self, phase: str, kind: str) -> float:
        """The host's time issuing one ``phase`` (forward, backward, wgrad) run of node ``kind``."""
        return self.calibration.host_us.get(f"{phase} {kind}", 0.0) * 1e-6

    def move_seconds(self, nbytes: float, kind: str) -> float:
        gbps = self.calibration.move_gbps.get(kind)
        return nbytes / (gbps * 1e9) if gbps else 0.0

    def parameter_pass_seconds(self, elements: float) -> float:
        """The step's memory-bound passes over a rank's fp32 parameters: their copy into
        the step's shards (read 4 bytes, write 2) and the fused AdamW update (read the
        parameter, its gradient and both moments, write the parameter and the moments:
        28 bytes)."""
        return elements * (6 + 28) / (self.calibration.hbm_gbps * 1e9)
