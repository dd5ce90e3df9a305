"""Pure layer functions: ``y = f(params_subtree, x, cfg)``, no modules, no state.
``ExpertBackend``, ``register_expert_backend`` and ``registered_backend`` are
re-exported from ``fmoe.backends``, where the table of named backends lives."""

from ..backends import ExpertBackend, register_expert_backend, registered_backend

from .attention import Documents, apply_rope, attend, attention, documents, project_qkv, rope_tables
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .embedding import embed
from .expert_parallel import ExpertParallel, combine, dispatch, from_experts, plan_exchange, to_experts
from .experts import (QUICK_GELU_ALPHA, DeferredWgrad, activation, add_expert_bias, dense_mlp, expert_mlp, glu_halves,
                      grouped_matmul, static_rows)
from .model import attention_half, block, cast_for_compute, forward, head_weight, lm_loss_sum, stack_stats
from .moe import MoEStats, Routed, moe, moe_experts, moe_output, moe_route
from .norm import rms_norm
from .router import Routing, route, router_loss
from .triton_kernels import fused_kernels_available
from . import kernel_ops  # noqa: F401  (registers the fmoe:: custom ops the kernels run as)

__all__ = [
    "QUICK_GELU_ALPHA", "DeferredWgrad", "Dispatch", "Documents", "ExpertBackend", "ExpertParallel", "MoEStats", "Routed",
    "Routing", "activation", "add_expert_bias", "apply_rope", "attend", "attention", "attention_half", "block", "capacity_rows", "cast_for_compute", "combine",
    "dense_mlp", "dispatch", "documents", "embed", "expert_mlp", "forward", "from_experts", "fused_kernels_available", "glu_halves",
    "grouped_matmul", "head_weight",
    "lm_loss_sum", "make_dispatch", "moe", "moe_experts", "moe_output", "moe_route", "permute",
    "plan_exchange", "project_qkv", "register_expert_backend", "registered_backend", "rms_norm", "rope_tables",
    "route", "router_loss", "row_weights", "stack_stats", "static_rows", "to_experts", "unpermute",
]
