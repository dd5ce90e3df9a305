"""Testing a pure layer function with deterministic inputs.

    python -m pytest examples/layer_test.py      (or: python examples/layer_test.py)

fmoe's layers are functions of (params, x, cfg), so a test builds exactly the
weights it wants, calls the function and checks numbers it can work out by hand.
"""

import torch

import fmoe

cfg = fmoe.ModelConfig(dim=4, heads=2, experts=2, topk=1, ffn=2, activation="relu2")


def layer_params():
    """Expert 0 doubles feature 0; expert 1 triples feature 1. The router sends
    tokens whose feature 0 is larger to expert 0, the others to expert 1."""
    fc1 = torch.zeros(2, 4, 2)
    fc2 = torch.zeros(2, 2, 4)
    fc1[0, 0, 0] = 1.0   # expert 0: h0 = x0
    fc2[0, 0, 0] = 2.0   #           y0 = 2 * relu(x0)^2
    fc1[1, 1, 0] = 1.0   # expert 1: h0 = x1
    fc2[1, 0, 1] = 3.0   #           y1 = 3 * relu(x1)^2
    router = torch.zeros(4, 2)
    router[0, 0] = router[1, 1] = 10.0
    return {"norm": torch.ones(4), "router": router, "expert_bias": torch.zeros(2),
            "experts": {"fc1": fc1, "fc2": fc2}}


def test_tokens_go_to_the_expert_the_router_prefers():
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0],    # -> expert 0: y0 = 2 * 1^2
                      [0.0, 2.0, 0.0, 0.0],    # -> expert 1: y1 = 3 * 2^2
                      [3.0, 1.0, 0.0, 0.0]])   # -> expert 0: y0 = 2 * 3^2
    y, stats = fmoe.layers.moe(layer_params(), x, cfg)
    # topk=1 with renormalised probabilities: each token's single prob is exactly 1.
    expected = torch.tensor([[2.0, 0, 0, 0], [0, 12.0, 0, 0], [18.0, 0, 0, 0]])
    torch.testing.assert_close(y, expected)
    assert stats.counts_E.tolist() == [2, 1]


def test_expert_bias_changes_the_choice_not_the_weight():
    p = layer_params()
    p["expert_bias"] = torch.tensor([0.0, 2.0])       # push everything to expert 1
    y, stats = fmoe.layers.moe(p, torch.tensor([[1.0, 0.5, 0.0, 0.0]]), cfg)
    assert stats.counts_E.tolist() == [0, 1]
    torch.testing.assert_close(y, torch.tensor([[0.0, 0.75, 0.0, 0.0]]))   # 3 * 0.5^2, prob 1


if __name__ == "__main__":
    test_tokens_go_to_the_expert_the_router_prefers()
    test_expert_bias_changes_the_choice_not_the_weight()
    print("layer tests passed")
