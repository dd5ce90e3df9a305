"""interop modules: same outputs and gradients as the pure functions, canonical
state_dict, torch.func.functional_call, drop-in use in a plain PyTorch model."""

import optree
import pytest
import torch

import fmoe
from fmoe.layers import moe
from fmoe.params import flat_shapes, named_leaves
from interop import FMoEModule, MoELayer

from .reference import assert_trees_close

CFG = fmoe.ModelConfig(vocab=32, dim=32, layers=2, heads=2, experts=4, topk=2, ffn=16, aux_loss_coef=0.01)


def test_module_loss_and_grads_equal_step():
    plan = fmoe.Plan(model=CFG, microbatches=2)
    m = FMoEModule(plan, seed=0)
    batch = {"tokens": torch.randint(0, 32, (4, 11), generator=torch.Generator().manual_seed(0))}
    loss = m(batch)
    loss.backward()
    out = fmoe.step(fmoe.init(plan, seed=0), batch, plan)
    assert torch.equal(loss.detach(), out.metrics["objective"])
    grads = optree.tree_map(lambda p: p.grad if p.grad is not None else torch.zeros_like(p), m.params())
    # One backward through both microbatches vs one per microbatch: the two partial
    # gradients of a leaf may be added in another order (fp32 rounding only).
    assert_trees_close(grads, out.grads, rtol=1e-6, atol=1e-9)


def test_state_dict_uses_canonical_paths_and_trains_with_torch_optim():
    plan = fmoe.Plan(model=CFG)
    m = FMoEModule(plan, seed=1)
    assert set(m.state_dict()) == set(flat_shapes(CFG))
    assert all(tuple(v.shape) == flat_shapes(CFG)[k] for k, v in m.state_dict().items())
    assert m.params()["layers"][1]["moe"]["experts"]["fc1"] is m.layers[1].moe.experts.fc1
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    batch = {"tokens": torch.arange(16).repeat(2, 2)[:, :17]}
    first = m(batch).item()
    for _ in range(10):
        opt.zero_grad()
        m(batch).backward()
        opt.step()
    assert m(batch).item() < first
    assert torch.equal(m.layers[0].moe.expert_bias, torch.zeros(4))


LAYER_CFG = fmoe.ModelConfig(dim=16, experts=4, topk=2, ffn=8, heads=2, shared_ffn=8, expert_biases=True)


def test_moe_layer_equals_the_pure_function():
    layer = MoELayer(LAYER_CFG, seed=3)
    pure = fmoe.init(fmoe.Plan(model=LAYER_CFG.replace(layers=1)), seed=3)["layers"][0]["moe"]
    prefix = "layers.0.moe."
    assert set(layer.state_dict()) == {k[len(prefix):] for k in flat_shapes(LAYER_CFG)
                                       if k.startswith(prefix) and k != prefix + "norm"}
    x = torch.randn(3, 5, 16)
    grad_y = torch.randn(3, 5, 16)
    y = layer(x)
    y.backward(grad_y)
    leaves = optree.tree_map(lambda t: t.clone().requires_grad_(), pure)
    leaves["expert_bias"].requires_grad_(False)
    y_ref, _ = moe(leaves, x.reshape(15, 16), LAYER_CFG)
    y_ref.backward(grad_y.reshape(15, 16))
    assert torch.equal(y, y_ref.view(3, 5, 16))
    for path, p in layer.named_parameters():
        ref = named_leaves(leaves)[path].grad
        assert (p.grad is None and ref is None) or torch.equal(p.grad, ref), path


def test_functional_call_round_trip():
    layer = MoELayer(LAYER_CFG, seed=0)
    other = {k: torch.randn_like(v) for k, v in layer.state_dict().items()}
    x = torch.randn(7, 16)
    got = torch.func.functional_call(layer, other, (x,))
    assert torch.equal(got, MoELayer(LAYER_CFG, params=_like(layer.params(), other))(x))
    assert not torch.equal(got, layer(x))  # the module's own weights were not used ...
    assert all(not torch.equal(layer.state_dict()[k], other[k]) for k in other)  # ... nor changed
    model = FMoEModule(fmoe.Plan(model=CFG), seed=0)
    swapped = {k: v * 1.5 for k, v in model.state_dict().items()}
    batch = {"tokens": torch.randint(0, 32, (2, 9))}
    want = fmoe.step(_like(model.params(), swapped), batch, fmoe.Plan(model=CFG)).metrics["objective"]
    assert torch.equal(torch.func.functional_call(model, swapped, (batch,)).detach(), want)


def _like(tree, flat: dict):
    """``flat`` (``{dotted path: tensor}``) in the structure of ``tree``."""
    return optree.tree_unflatten(optree.tree_structure(tree), [flat[p] for p in named_leaves(tree)])


def test_moe_layer_replaces_a_dense_mlp_and_trains():
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.mlp = mlp

        def forward(self, h):
            return h + self.mlp(self.norm(h))

    dense = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    x, target = torch.randn(64, 16), torch.randn(64, 16)
    for mlp in (dense, MoELayer(LAYER_CFG.replace(aux_loss_coef=0.01), seed=0)):
        block = Block(mlp)
        opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
        first = torch.nn.functional.mse_loss(block(x), target).item()
        for _ in range(30):
            opt.zero_grad()
            torch.nn.functional.mse_loss(block(x), target).backward()
            opt.step()
        assert torch.nn.functional.mse_loss(block(x), target).item() < 0.9 * first
    y, stats = block.mlp(x, return_stats=True)
    assert y.shape == x.shape and stats.aux_loss.requires_grad


def test_moe_layer_rejects_params_of_another_config():
    params = MoELayer(LAYER_CFG).params()
    with pytest.raises(ValueError, match="do not match the ModelConfig's MoE layer"):
        MoELayer(LAYER_CFG.replace(experts=8), params=params)
    with pytest.raises(ValueError, match="ModelConfig.dim=16"):
        MoELayer(LAYER_CFG)(torch.randn(4, 8))
