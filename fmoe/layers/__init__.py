"""Pure layer functions: ``y = f(params_subtree, x, cfg)``, no modules. What they keep
between calls is keyed by immutable values: compiled Triton kernels and bound
``Kernels`` per process; the named expert backends live in ``fmoe.backends``
(``ExpertBackend``, ``register_expert_backend`` and ``registered_backend`` are
re-exported from there); ``FMOE_FUSED_KERNELS=0`` (read at each kernel call) turns the
Triton kernels off."""

from ..backends import ExpertBackend, register_expert_backend, registered_backend

from .attention import attend, attention, project_qkv
from .block_masks import Documents, documents
from .rope import apply_rope, rope_tables
from .dispatch import Dispatch, capacity_rows, make_dispatch, permute, row_weights, unpermute
from .embedding import embed
from .expert_parallel import ExpertParallel, combine, dispatch, from_experts, plan_exchange, to_experts
from .experts import (QUICK_GELU_ALPHA, DeferredWgrad, activation, add_expert_bias, dense_mlp, expert_mlp, glu_halves,
                      grouped_matmul, static_rows)
from .attention import attention_half
from .loss import head_loss_sum, head_weight
from .model import block, cast_for_compute, forward, lm_loss_sum, stack_stats
from .moe import MoEStats, Routed, moe_experts, moe_output, moe_route
from .nodes import (EAGER, NODES, Attended, Kernels, Kind, Landing, NodeSpec, Sent, attn_node, bound_kernels,
                    combine_node, dispatch_node, experts_node, land_node, layer_forward, moe, moe_forward, route_node)
from .norm import rms_norm
from .router import Routing, route, router_loss, router_share
from .triton_kernels import fused_kernels_available
from . import kernel_ops  # noqa: F401  (registers the fmoe:: custom ops the kernels run as)

__all__ = [
    "Attended", "DeferredWgrad", "Dispatch", "Documents", "EAGER", "ExpertBackend", "ExpertParallel", "Kernels",
    "Kind", "Landing", "MoEStats", "NODES", "NodeSpec", "QUICK_GELU_ALPHA", "Routed", "Routing", "Sent",
    "activation", "add_expert_bias", "apply_rope", "attend", "attention", "attention_half", "attn_node", "block",
    "bound_kernels", "capacity_rows", "cast_for_compute", "combine", "combine_node", "dense_mlp", "dispatch",
    "dispatch_node", "documents", "embed", "expert_mlp", "experts_node", "forward", "from_experts",
    "fused_kernels_available", "glu_halves", "grouped_matmul", "head_loss_sum", "head_weight", "land_node",
    "layer_forward", "lm_loss_sum", "make_dispatch", "moe", "moe_experts", "moe_forward", "moe_output", "moe_route",
    "permute", "plan_exchange", "project_qkv", "register_expert_backend", "registered_backend", "rms_norm",
    "rope_tables", "route", "route_node", "router_loss", "router_share", "row_weights", "stack_stats",
    "static_rows", "to_experts", "unpermute",
]
