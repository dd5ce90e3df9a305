"""Pure layer functions: ``y = f(params_subtree, x, cfg)``, no modules, no state."""

from .attention import apply_rope, attention, rope_tables
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .expert_parallel import ExpertParallel, all_to_all, combine, dispatch, plan_exchange
from .experts import activation, add_expert_bias, dense_mlp, expert_mlp, glu_halves, grouped_matmul
from .model import block, cast_for_compute, forward, lm_loss_sum, stack_stats
from .moe import MoEStats, moe
from .norm import rms_norm
from .router import Routing, route

__all__ = [
    "Dispatch", "MoEStats", "Routing", "activation", "add_expert_bias", "apply_rope", "attention", "block",
    "ExpertParallel", "all_to_all", "capacity_rows", "combine", "dispatch", "plan_exchange",
    "cast_for_compute", "dense_mlp", "expert_mlp", "forward", "glu_halves", "grouped_matmul",
    "lm_loss_sum", "make_dispatch", "moe", "permute", "rms_norm", "rope_tables", "route",
    "row_weights", "stack_stats", "unpermute",
]
