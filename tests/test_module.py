"""interop.FMoEModule: same loss and gradients as fmoe.step, canonical state_dict."""

import optree
import torch

import fmoe
from fmoe.params import flat_shapes
from interop import FMoEModule

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
    for a, b in zip(optree.tree_leaves(grads), optree.tree_leaves(out.grads)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


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
