"""Pure layer functions: ``y = f(params_subtree, x, cfg)``, no modules, no state."""

from .attention import apply_rope, attend, attention, project_qkv, rope_tables
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .embedding import embed
from .expert_parallel import ExpertParallel, combine, dispatch, from_experts, plan_exchange, to_experts
from .experts import (DeferredWgrad, activation, add_expert_bias, dense_mlp, expert_mlp, glu_halves,
                      grouped_matmul)
from .model import block, cast_for_compute, forward, head_weight, lm_loss_sum, stack_stats
from .moe import MoEStats, Routed, moe, moe_experts, moe_output, moe_route
from .norm import rms_norm
from .router import Routing, route
from .triton_kernels import fused_kernels_available
from . import kernel_ops  # noqa: F401  (registers the fmoe:: custom ops the kernels run as)

__all__ = [
    "DeferredWgrad", "Dispatch", "ExpertParallel", "MoEStats", "Routed", "Routing", "activation",
    "add_expert_bias", "apply_rope", "attend", "attention", "block", "capacity_rows", "cast_for_compute", "combine",
    "dense_mlp", "dispatch", "embed", "expert_mlp", "forward", "from_experts", "fused_kernels_available", "glu_halves",
    "grouped_matmul", "head_weight",
    "lm_loss_sum", "make_dispatch", "moe", "moe_experts", "moe_output", "moe_route", "permute",
    "plan_exchange", "project_qkv", "rms_norm", "rope_tables", "route", "row_weights", "stack_stats", "to_experts",
    "unpermute",
]
