"""How fast learned routing collapses from initialisation: fmoe's model against Hugging
Face's own ``Qwen3MoeForCausalLM`` (when transformers is installed), the same shape, each
with its own initialisation, trained with AdamW on uniform random tokens; per layer, the
busiest expert's rows over the mean (``expert_load``: 1 is even, E/K means every token
picks the same K experts). CPU, fp32, a few minutes.

    python benchmarks/routing_collapse.py                       # aux loss 0, both models
    python benchmarks/routing_collapse.py --aux-loss 0.1        # a strong load-balancing loss
    python benchmarks/routing_collapse.py --freeze-router --models fmoe   # the router never moves
    python benchmarks/routing_collapse.py --expert-bias-rate 1e-2 --models fmoe

With the router frozen (zero gradients: fmoe's weight decay still shrinks it by
lr x 0.1 a step, which moves no top-k) the collapse comes from the hidden states (every
token's normalised input shares one direction), not from the router.
"""

from __future__ import annotations

import argparse

import torch

import fmoe
from fmoe.trainer.metrics import expert_load


def _shape(a):
    return dict(vocab=a.vocab, dim=a.dim, layers=a.layers, heads=4, kv_heads=2, head_size=128, experts=a.experts,
                topk=a.topk, ffn=128)


def fmoe_loads(a, batches):
    """``expert_load`` per layer at every ``--every``-th step of fmoe's model."""
    cfg = fmoe.ModelConfig(**_shape(a), qk_norm="head", norm_topk_prob=True, rope_theta=1e6,
                           aux_loss_coef=a.aux_loss, expert_bias_rate=a.expert_bias_rate, activation="swiglu")
    plan = fmoe.Plan(model=cfg, dtype="float32")
    params = fmoe.init(plan, seed=0)
    opt = fmoe.adamw(lr=a.lr, weight_decay=0.1, max_grad_norm=1.0)
    state = opt.init(params)
    for n, tokens in enumerate(batches):
        out = fmoe.step(params, {"tokens": tokens}, plan)
        if n % a.every == 0:
            yield n, expert_load(out.metrics["expert_counts"]).tolist()
        grads = out.grads
        if a.freeze_router:
            grads = {**grads, "layers": [{**g, "moe": {**g["moe"], "router": torch.zeros_like(g["moe"]["router"])}}
                                         for g in grads["layers"]]}
        params, state = opt.update(grads, state, params)
        params = fmoe.update_expert_bias(params, out.metrics["expert_counts"], a.expert_bias_rate)


def hf_loads(a, batches):
    """The same for transformers' ``Qwen3MoeForCausalLM`` and ``torch.optim.AdamW``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    s = _shape(a)
    cfg = Qwen3MoeConfig(vocab_size=s["vocab"], hidden_size=s["dim"], num_hidden_layers=s["layers"],
                         num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_size"],
                         num_experts=s["experts"], num_experts_per_tok=s["topk"], moe_intermediate_size=s["ffn"],
                         norm_topk_prob=True, rope_theta=1e6, router_aux_loss_coef=a.aux_loss,
                         output_router_logits=True, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    for name, p in model.named_parameters():
        if a.freeze_router and name.endswith("mlp.gate.weight"):
            p.requires_grad_(False)  # no gradient: out of the clip's norm too, as fmoe's zeroed one
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.1)
    for n, tokens in enumerate(batches):
        out = model(input_ids=tokens[:, :-1], output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        if n % a.every == 0:
            counts = [torch.bincount(logits.topk(s["topk"], -1).indices.flatten(), minlength=s["experts"])
                      for logits in out.router_logits]
            yield n, expert_load(torch.stack(counts)).tolist()
        objective = loss + a.aux_loss * out.aux_loss if a.aux_loss else loss
        opt.zero_grad()
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["fmoe", "hf"], choices=["fmoe", "hf"])
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--every", type=int, default=5, help="print every N steps")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--aux-loss", type=float, default=0.0)
    p.add_argument("--expert-bias-rate", type=float, default=0.0, help="fmoe only")
    p.add_argument("--freeze-router", action="store_true", help="the router's weights never move")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g) for _ in range(a.steps)]
    print(f"expert_load per layer (1: even; {a.experts // a.topk}: every token picks the same {a.topk} experts)")
    for name in a.models:
        for n, loads in (fmoe_loads if name == "fmoe" else hf_loads)(a, batches):
            print(f"{name:5s} step {n:3d}: " + " ".join(f"{x:5.2f}" for x in loads), flush=True)


if __name__ == "__main__":
    main()
