"""``resolve(plan) -> Setup``: everything a step derives from its plan, derived once.

The parameter table, the shard spec, the programs and their double-buffer slots and
live-unit bound are pure functions of the plan, cached per plan; the kernels (compiled
or eager, with ``Plan.fp8``'s products and the expert backend bound in) are looked up
at each call and the mesh (this process's groups) at its first use, since process
groups and registered backends belong to the process and a mesh may create groups,
which only happens once every check has passed. Everything below ``fmoe.step`` takes the
Setup, or the piece of it it needs, never the plan to derive from again.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .backends import bound_backend
from .config import Plan
from .comm.collectives import Group
from .comm.mesh import Mesh, mesh_for
from .layers.fp8 import GEMMS
from .layers.nodes import Kernels
from .layers.context_parallel import ContextParallel
from .layers.parallel import Parallel
from .layers.tensor_parallel import TensorParallel
from .lora_sites import adapted_params
from .params import ParamTable
from .schedule.actions import Action, Backward
from .schedule.compiled import kernels_for
from .schedule.pipeline import crossing_peers
from .schedule.program import Scheduling, build_program, double_buffer_slots, max_live_units, node_uses
from .shard.spec import Sharding, ShardSpec, shard_spec


@dataclass(frozen=True)
class Program:
    """One program of a plan and what running it needs.

    Attributes:
        actions: the actions in order.
        slots: ``{unit: 0 or 1}`` under ``gather_buffers='double'``, else None.
        max_live: most units gathered or gathering at once.
        trains: whether it has backward actions (its reductions are expected).
    """

    actions: tuple[Action, ...]
    slots: dict | None
    max_live: int
    trains: bool

    def with_actions(self, actions) -> "Program":
        """The same program with other actions (a test's deliberately wrong one)."""
        actions = tuple(actions)
        return dataclasses.replace(self, actions=actions, trains=any(isinstance(a, Backward) for a in actions))


@dataclass(frozen=True)
class StagePlan:
    """What a plan derives for one pipeline stage with no process state: the ShardSpec
    and the stage's Programs, each built when first asked for (``resolve_stage``; what
    the planner simulates).

    Attributes:
        plan, stage: the Plan and the pipeline stage.
        spec: the ShardSpec.
        train, eval: the Programs of a training step and of a forward-only one.
        scheduling: what those Programs read of the plan (``Scheduling``).
        execution: what the executor reads of the plan (``Execution``).
    """

    plan: Plan
    stage: int
    spec: ShardSpec

    @functools.cached_property
    def train(self) -> Program:
        return _program(self.scheduling, self.spec, self.stage, True)

    @functools.cached_property
    def eval(self) -> Program:
        return _program(self.scheduling, self.spec, self.stage, False)

    @functools.cached_property
    def scheduling(self) -> "Scheduling":
        return scheduling(self.plan)

    @functools.cached_property
    def execution(self) -> "Execution":
        return Execution.of(self.plan)

    def program(self, train: bool) -> Program:
        return self.train if train else self.eval


@dataclass(frozen=True)
class Execution:
    """What the executor reads of a plan at every run, read from it once (``Setup.execution``).

    Attributes:
        model: the ModelConfig.
        microbatches: ``Plan.microbatches``.
        loss_chunk: ``Plan.loss_chunk`` (0: the whole loss at once).
        delay_wgrad: ``Plan.delay_wgrad``.
        remat_layers: ``Plan.remat='full'``: a layer's forward keeps its input, its backward recomputes.
        records_collectives: eager kernels (not ``Plan.compile``) record their collectives for the trace.
        expert_parallel: ``Plan.ep > 1``; ``tokens_cross_once``: ``Plan.ep_exchange='tokens'``.
        device: the plan's device.
        allocates_each_gather: ``Plan.gather_buffers='dynamic'``.
        stream_dtype, stream_tp: the pipeline stream's dtype and the ranks that split its positions.
        adapted: under ``Plan.lora``, the adapters on each adapted parameter and their scale,
            ``((path, alpha / rank, ((adapter name, first column, end column), ...)), ...)``
            (``fmoe.schedule.adapters``); None without adapters.
    """

    model: object
    microbatches: int
    loss_chunk: int
    delay_wgrad: bool
    remat_layers: bool
    records_collectives: bool
    expert_parallel: bool
    tokens_cross_once: bool
    device: torch.device
    allocates_each_gather: bool
    stream_dtype: torch.dtype
    stream_tp: int
    adapted: tuple | None = None

    @classmethod
    def of(cls, plan: Plan) -> "Execution":
        adapted = None if plan.lora is None else \
            tuple((path, plan.lora.scale, on) for path, on in adapted_params(plan.lora, plan.model).items())
        return cls(plan.model, plan.microbatches, plan.loss_chunk, _delays_wgrad(plan), plan.remat_mode.whole_layers,
                   not plan.compile, plan.ep > 1, plan.ep_exchange_mode.tokens_cross_once,
                   torch.device(plan.device), plan.gather_buffers_mode.allocated_each_gather, plan.compute_dtype,
                   plan.tp, adapted)


def _delays_wgrad(plan: Plan) -> bool:
    """``Plan.delay_wgrad``, unless ``Plan.lora`` freezes the weights it would delay the GEMMs of."""
    return plan.delay_wgrad and plan.lora is None


@dataclass(frozen=True)
class Setup:
    """A plan resolved once: what every step under it runs with.

    Attributes:
        plan: the Plan.
        spec: the ShardSpec: units, buffer groups, who holds which rows; ``table``:
            the model's ParamTable.
        train, eval: the Programs of a training step and of a forward-only one.
        kernels: the functions inside the nodes (``Plan.compile``, ``Plan.remat``,
            ``Plan.fp8`` and the expert backend bound in).
        execution: what the executor reads of the plan (the StagePlan's, read once per plan).
        stage: this process's pipeline stage (0 without pipeline parallelism): its
            Programs are that stage's, and it holds that stage's units
            (``units``).
        mesh: this process's groups for the plan (made at first use); ``parallel``:
            those the kernels take.
    """

    plan: Plan
    spec: ShardSpec
    train: Program
    eval: Program
    kernels: Kernels
    execution: Execution
    stage: int = 0

    @property
    def table(self) -> ParamTable:
        return self.spec.table

    @functools.cached_property
    def peers(self) -> tuple[int | None, int | None] | None:
        """This rank's neighbours in the stage before and after it (None without
        pipeline parallelism)."""
        if self.plan.pp == 1:
            return None
        return crossing_peers(self.plan.dims, self.mesh.world.rank, self.plan.virtual_stages > 1)

    @functools.cached_property
    def mesh(self) -> Mesh:
        return mesh_for(self.plan)

    @functools.cached_property
    def parallel(self) -> Parallel:
        """The mesh's tensor-, context- and expert-tensor-parallel groups as the kernels
        take them (``fmoe.layers.parallel``)."""
        mesh = self.mesh

        def of(group, name):
            return TensorParallel(group.size, group.rank, group.group, name) if group.size > 1 else None

        cp = mesh.cp
        return Parallel(tp=of(mesh.tp, "tp"), cp=ContextParallel(cp.size, cp.rank, cp.group) if cp.size > 1 else None,
                        etp=of(mesh.etp, "etp"))

    @property
    def units(self):
        """The UnitSpecs this process holds: its stage's."""
        return self.spec.stage_units(self.stage)

    def program(self, train: bool) -> Program:
        return self.train if train else self.eval


def resolve(plan: Plan) -> Setup:
    """The Setup of ``plan`` on this process (the pure part cached per plan).

    Raises:
        ValueError: the plan's schedule cannot run in its buffers (double buffering
            whose slots would collide), before anything runs.
    """
    stage = plan.dims.stage(Group.world().rank) if plan.pp > 1 else 0
    pure = resolve_stage(plan, stage)
    return Setup(plan, pure.spec, pure.train, pure.eval, plan_kernels(plan), pure.execution, stage)


def plan_kernels(plan: Plan) -> Kernels:
    """The Kernels a step under ``plan`` runs unless told otherwise (``kernels_for``): compiled
    or eager, ``Plan.remat='selective'``'s policy, ``Plan.fp8``'s products and the expert
    backend (looked up here, once: ``fmoe.runtime`` checked it is loaded)."""
    return kernels_for(plan.compile, plan.remat_mode.selected_kernels, GEMMS[plan.fp8],
                       bound_backend(plan.expert_backend))


@functools.lru_cache(maxsize=256)
def resolve_stage(plan: Plan, stage: int = 0) -> StagePlan:
    """The pure part of resolving ``plan`` for pipeline stage ``stage`` (the whole step
    without pipeline parallelism): its ShardSpec and Programs (cached per plan and stage)."""
    spec = shard_spec(plan.model, plan.dims, Sharding(plan.sharding), plan.stages, plan.unit_groups,
                      plan.compute_dtype, plan.fp8 == "tensorwise")
    return StagePlan(plan, stage, spec)


def scheduling(plan: Plan) -> Scheduling:
    """What ``plan``'s programs depend on of it, read once."""
    return Scheduling(plan.model, plan.microbatches, plan.schedule_mode, _delays_wgrad(plan),
                      plan.remat_mode.whole_layers, plan.pp, plan.stages, plan.prefetch,
                      plan.gather_buffers_mode.two_slots)


def norm_layout(plan: Plan) -> tuple[int, Callable[[], tuple] | None]:
    """What the gradient norm of trees shaped like ``fmoe.init(plan)`` needs
    (``fmoe.optim.grad_norm_fn`` builds its NormFn of it): the ranks the trees are split
    over, and on several a function giving the ShardSpec (cached) and the mesh, whose
    groups are looked up at each call (as ``fmoe.step`` does; a process group must exist
    by then) and never held: ``destroy_process_group()`` frees them. Under ``plan.lora``
    the trees are adapters, whole on every rank in this version: one rank's norm is the
    norm."""
    if plan.world == 1 or plan.lora is not None:
        return 1, None
    return plan.world, lambda: (resolve_stage(plan, 0).spec, mesh_for(plan))


def stage_program(plan: Plan, stage: int, train: bool) -> Program:
    """The Program pipeline stage ``stage`` of ``plan`` runs: a training step's, or a
    forward-only one's (pure, cached)."""
    return resolve_stage(plan, stage).program(train)


def _program(how: Scheduling, spec: ShardSpec, stage: int, train: bool) -> Program:
    uses = node_uses(how, spec, train, stage)
    actions = build_program(how, spec, uses)
    return Program(actions, double_buffer_slots(how, spec, actions), max_live_units(how, spec, uses), train)


def check_memory(setup: Setup) -> None:
    """Raise ValueError if ``Plan.gather_buffers='persistent'`` cannot keep every unit
    gathered in the device's free memory (checked before any collective)."""
    plan, spec = setup.plan, setup.spec
    device = torch.device(plan.device)
    if not plan.gather_buffers_mode.kept or device.type != "cuda":
        return
    need = sum(layout.full_size * torch.empty((), dtype=spec.dtype(key)).element_size()
               for u in setup.units for key, layout in u.groups.items() if spec.sharded(key.domain))
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise ValueError(f"Plan.gather_buffers='persistent' keeps every unit gathered: {need / 2**30:.1f} GiB, "
                         f"but {device} has {free / 2**30:.1f} GiB free (allowed: 'dynamic' or 'double')")
