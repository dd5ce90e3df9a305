"""fmoe as ``nn.Module``s, for code that wants them.

- ``FMoEModule``: the whole language model.
- ``MoELayer``: one MoE layer (router, experts, optional shared expert), a drop-in
  replacement for a dense MLP in an existing model: ``[..., D] -> [..., D]``.

The canonical parameter pytree is held as ``nn.Parameter``s in nested modules whose
names follow the layout, so ``state_dict()`` keys are the canonical paths
(``layers.0.moe.experts.fc1``; a ``MoELayer``'s are those under ``layers.<i>.moe``).
``forward`` calls fmoe's pure functions under plain autograd: no hooks, and
``torch.optim`` and ``torch.func.functional_call`` work as usual.
"""

from __future__ import annotations

import torch
from torch import nn

import fmoe
from fmoe.layers import cast_for_compute, moe
from fmoe.params import flat_shapes, named_leaves, trainable
from fmoe.resolve import resolve
from fmoe.step import check_batch, check_params, global_targets, microbatch_objective


def _attach(module: nn.Module, tree: dict) -> None:
    for name, value in tree.items():
        if isinstance(value, torch.Tensor):
            module.register_parameter(name, nn.Parameter(value, requires_grad=trainable(name)))
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
    next-token cross-entropy over the counted targets, ``loss_mask`` and ``segments``
    included, plus router losses when their coefficients are set),
    and ``backward()`` leaves the same gradients in ``.grad``.
    """

    def __init__(self, plan: fmoe.Plan, seed: int = 0, params: dict | None = None):
        super().__init__()
        if plan.lora is not None:
            raise ValueError("Plan.lora is invalid for FMoEModule: its Parameters are the whole model's; adapters "
                             "train through fmoe.step(adapters, batch, plan, base=params) (or GraphedTrainStep with "
                             "base=): allowed: Plan.lora=None")
        tree = fmoe.init(plan, seed) if params is None else params
        check_params(tree, plan)
        self.plan = plan
        _attach(self, tree)

    def params(self) -> dict:
        """The pytree view: the module's own Parameters in the canonical layout."""
        return _tree_of(self)

    def forward(self, batch: dict) -> torch.Tensor:
        checked = check_batch(batch, self.plan)
        total = global_targets(checked, resolve(self.plan).mesh)  # one process: its own count, none refused
        params = self.params()
        return sum(microbatch_objective(params, mb, self.plan, total)[0]
                   for mb in checked.microbatches(self.plan.microbatches))


class MoELayer(nn.Module):
    """One routed MoE layer as a module: ``y = moe(x)``, no norm and no residual (the
    model around it keeps its own, as it did for the dense MLP this replaces).

    Arguments:
        cfg: the ModelConfig (``dim``, experts, router, activation, shared expert...).
        seed: init seed; the weights are those of layer 0 of ``fmoe.init`` with ``seed``.
        params: start from this ``moe`` subtree (``router``, ``expert_bias``,
            ``experts``, optional ``shared``; a ``norm`` entry is ignored) instead.
        backend: expert matmul backend (``torch`` or ``loop``).

    ``forward(x)`` takes ``[..., D]`` in any float dtype and returns ``[..., D]`` in
    that dtype (router, expert bias and expert biases stay fp32); with
    ``return_stats=True`` it returns ``(y, MoEStats)``, whose ``aux_loss`` and
    ``z_loss`` the caller adds to its loss with its own coefficients.
    """

    def __init__(self, cfg: fmoe.ModelConfig, seed: int = 0, params: dict | None = None,
                 backend: str = "torch"):
        super().__init__()
        # a MoE layer whatever cfg's layer 0 is; it does not attend, so no window either
        one_layer = cfg.replace(layers=1, dense_layers=(), dense_ffn=0, sliding_window=0, window_layers=())
        if params is None:
            params = fmoe.init(fmoe.Plan(model=one_layer), seed)["layers"][0]["moe"]
        tree = {k: v for k, v in params.items() if k != "norm"}
        prefix = "layers.0.moe."
        want = {path[len(prefix):]: shape for path, shape in flat_shapes(one_layer).items()
                if path.startswith(prefix) and path != prefix + "norm"}
        got = {path: tuple(t.shape) for path, t in named_leaves(tree).items()}
        if got != want:
            wrong = sorted(set(got.items()) ^ set(want.items()))
            raise ValueError(f"MoELayer params do not match the ModelConfig's MoE layer; differing (path, shape): "
                             f"{wrong[:6]}")
        self.cfg, self.backend = cfg, backend
        _attach(self, tree)

    def params(self) -> dict:
        """The layer's ``moe`` subtree (without ``norm``) over the module's own Parameters."""
        return _tree_of(self)

    def forward(self, x: torch.Tensor, return_stats: bool = False):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() == 0:
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MoELayer input must be a float tensor [..., dim={self.cfg.dim}] of hidden states, "
                             f"got {got} (token ids go through an embedding first)")
        if x.shape[-1] != self.cfg.dim:
            raise ValueError(f"MoELayer input has last dimension {x.shape[-1]}; ModelConfig.dim={self.cfg.dim}")
        params = cast_for_compute(self.params(), x.dtype)
        y_TD, stats = moe(params, x.reshape(-1, x.shape[-1]), self.cfg, self.backend)
        y = y_TD.view_as(x)
        return (y, stats) if return_stats else y
