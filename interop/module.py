"""``FMoEModule``: the whole fmoe model as an ``nn.Module``, for code that wants one.

The canonical parameter pytree is held as ``nn.Parameter``s in nested modules whose
names follow the layout, so ``state_dict()`` keys are the canonical paths
(``layers.0.moe.experts.fc1``). ``forward`` calls fmoe's pure functions under plain
autograd: no hooks, and ``torch.optim`` works as usual.
"""

from __future__ import annotations

import torch
from torch import nn

import fmoe
from fmoe.step import check_batch, check_params, microbatch_objective, num_targets


def _attach(module: nn.Module, tree: dict) -> None:
    for name, value in tree.items():
        if isinstance(value, torch.Tensor):
            # The expert bias is balanced from routing counts, not trained by gradient.
            module.register_parameter(name, nn.Parameter(value, requires_grad=name != "expert_bias"))
        elif isinstance(value, list):
            module.add_module(name, nn.ModuleList(_child(v) for v in value))
        else:
            module.add_module(name, _child(value))


def _child(tree: dict) -> nn.Module:
    m = nn.Module()
    _attach(m, tree)
    return m


def _tree_of(module: nn.Module):
    if isinstance(module, nn.ModuleList):
        return [_tree_of(m) for m in module]
    tree = dict(module.named_parameters(recurse=False))
    tree.update((name, _tree_of(child)) for name, child in module.named_children())
    return tree


class FMoEModule(nn.Module):
    """The MoE language model as a module.

    Arguments:
        plan: the Plan (one process: ``dp = ep = 1``).
        seed: init seed, as ``fmoe.init(plan, seed)``.
        params: start from this canonical pytree instead of a fresh init.

    ``module(batch)`` returns the same scalar ``fmoe.step`` differentiates (the mean
    next-token cross-entropy, plus router losses when their coefficients are set),
    and ``backward()`` leaves the same gradients in ``.grad``.
    """

    def __init__(self, plan: fmoe.Plan, seed: int = 0, params: dict | None = None):
        super().__init__()
        tree = fmoe.init(plan, seed) if params is None else params
        check_params(tree, plan)
        self.plan = plan
        _attach(self, tree)

    def params(self) -> dict:
        """The pytree view: the module's own Parameters in the canonical layout."""
        return _tree_of(self)

    def forward(self, batch: dict) -> torch.Tensor:
        tokens = check_batch(batch, self.plan)
        params = self.params()
        return sum(microbatch_objective(params, mb, self.plan, num_targets(tokens))[0]
                   for mb in tokens.chunk(self.plan.microbatches))
