"""Naive references, written independently of fmoe's layers: loops and formulas.

Everything here is meant to be run in float64 on tiny shapes.
"""

import math

import optree
import torch

import fmoe


def seed_of_this_test() -> int:
    """A seed drawn from the test's own RNG (``conftest.seeded_rng``): another in each
    test, the same in every run (``torch.seed()`` would re-seed from the OS: a failure
    could not be replayed)."""
    return int(torch.randint(2**31, ()))


def random_params(cfg, seed=0, dtype=torch.float64, scale=0.3):
    """A params pytree in ``cfg``'s layout with every leaf random (no zeros, no ones)."""
    g = torch.Generator().manual_seed(seed)

    def draw(path, shape):
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        name = path[-1]
        if name.endswith("norm"):
            return (1 + 0.2 * t).to(dtype)
        if name == "expert_bias":
            return (0.05 * t).to(dtype)
        if name.endswith("bias"):
            return (0.1 * t).to(dtype)
        fan_in = shape[-2] if len(shape) >= 2 else 1
        return (t * scale / math.sqrt(fan_in) * 3).to(dtype)

    return optree.tree_map_with_path(draw, fmoe.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple),
                                     none_is_leaf=False)


def rms_norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x_SHd, theta, positions=None, dims=None, cfg=None):
    """Rotate pairs (i, i + r/2) at position s by s * theta^(-2i/r), one position at a time
    (``positions``: each row's own position instead of its index; ``dims``: r, the
    features rotated, all d by default; the rest are copied; ``cfg`` with
    ``rope_scaling='yarn'``: YaRN's frequencies and cos/sin factor, ``yarn_frequency``)."""
    S, H, d = x_SHd.shape
    r = dims or d
    out = x_SHd.clone()
    half = r // 2
    yarn = cfg is not None and cfg.rope_scaling == "yarn"
    gain = yarn_cos_factor(cfg) if yarn else 1.0
    for s in range(S):
        pos = s if positions is None else int(positions[s])
        for i in range(half):
            freq = yarn_frequency(i, r, theta, cfg) if yarn else theta ** (-2.0 * i / r)
            ang = pos * freq
            c, sn = gain * math.cos(ang), gain * math.sin(ang)
            a, b = x_SHd[s, :, i], x_SHd[s, :, i + half]
            out[s, :, i] = a * c - b * sn
            out[s, :, i + half] = b * c + a * sn
    return out


def yarn_m(factor, s):
    """YaRN's 0.1 s ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * s * math.log(factor) + 1.0


def yarn_cos_factor(cfg):
    """What YaRN multiplies cos and sin by (the paper's sqrt(1/t), DeepSeek's mscale ratio)."""
    if cfg.yarn_attention_factor:
        return cfg.yarn_attention_factor
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return yarn_m(cfg.rope_factor, cfg.yarn_mscale) / yarn_m(cfg.rope_factor, cfg.yarn_mscale_all_dim)
    return yarn_m(cfg.rope_factor, 1.0)


def yarn_frequency(i, r, theta, cfg):
    """YaRN (arXiv 2309.00071, "NTK-by-parts") for pair i of r rotated features: the pair
    turns L / wavelength times over the original context L; above beta_fast turns it
    keeps theta^(-2i/r), below beta_slow it takes that / factor, linear in i between
    (the ends as pair indices, rounded outwards when truncating)."""
    L = cfg.rope_original_max

    def pair_at(turns):  # solve L / (2 pi theta^(2i/r)) = turns for i
        return r / 2 * math.log(L / (2 * math.pi * turns)) / math.log(theta)

    lo, hi = pair_at(cfg.yarn_beta_fast), pair_at(cfg.yarn_beta_slow)
    if cfg.yarn_truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    if hi == lo:
        hi += 0.001
    ramp = min(1.0, max(0.0, (i - lo) / (hi - lo)))  # 0: keep, 1: interpolate
    base = theta ** (-2.0 * i / r)
    return base * (1 - ramp) + base / cfg.rope_factor * ramp


def yarn_softmax_gain(cfg):
    """DeepSeek-V3's YaRN correction of the 1/sqrt(d) softmax scale: m(mscale_all_dim)^2
    (1 without one)."""
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        return yarn_m(cfg.rope_factor, cfg.yarn_mscale_all_dim) ** 2
    return 1.0


def document_positions(doc_S):
    """Each position's index inside its document (a run of equal ids), one at a time."""
    out, start = [], 0
    for s in range(len(doc_S)):
        if s and doc_S[s] != doc_S[s - 1]:
            start = s
        out.append(s - start)
    return out


def qkv_heads(p, x_SD, cfg, positions):
    """One sequence's queries ``[S, H, d]``, keys and values ``[S, KV, d]`` from ``qkv``."""
    S, eps = x_SD.shape[0], cfg.norm_eps
    H, KV, d = cfg.heads, cfg.kv_heads or cfg.heads, cfg.head_dim
    qkv = x_SD @ p["qkv"]
    if "qkv_bias" in p:
        qkv = qkv + p["qkv_bias"]
    q, k, v = qkv[:, :H * d], qkv[:, H * d:(H + KV) * d], qkv[:, (H + KV) * d:]
    if cfg.qk_norm == "full":
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    q, k, v = q.reshape(S, H, d), k.reshape(S, KV, d), v.reshape(S, KV, d)
    if cfg.qk_norm == "head":
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    q, k = (rope(t, cfg.rope_theta, positions, cfg.rope_dims, cfg) for t in (q, k))
    return q, k, v


def rope_pairs(x_SHr, theta, positions=None, cfg=None):
    """Rotate adjacent pairs (2i, 2i + 1) by s * theta^(-2i/r) (DeepSeek's interleaved
    layout), one position and pair at a time."""
    S, H, r = x_SHr.shape
    out = x_SHr.clone()
    yarn = cfg is not None and cfg.rope_scaling == "yarn"
    gain = yarn_cos_factor(cfg) if yarn else 1.0
    for s in range(S):
        pos = s if positions is None else int(positions[s])
        for i in range(r // 2):
            ang = pos * (yarn_frequency(i, r, theta, cfg) if yarn else theta ** (-2.0 * i / r))
            c, sn = gain * math.cos(ang), gain * math.sin(ang)
            a, b = x_SHr[s, :, 2 * i], x_SHr[s, :, 2 * i + 1]
            out[s, :, 2 * i], out[s, :, 2 * i + 1] = a * c - b * sn, b * c + a * sn
    return out


def latent_heads(p, x_SD, cfg, positions):
    """Multi-head latent attention's queries and keys ``[S, H, d]`` and values
    ``[S, H, dv]``, as DeepSeek-V3 writes them: q from the (low-rank) query projection,
    a normalised latent up-projected to each head's unrotated key and value, one rotated
    key part ``[S, r]`` appended to every head's key."""
    S, H, eps = x_SD.shape[0], cfg.heads, cfg.norm_eps
    d, r, dv = cfg.head_dim, cfg.rope_head_dim, cfg.v_head_dim
    q = x_SD @ p["q"] if "q" in p else rms_norm(x_SD @ p["q_down"], p["q_down_norm"], eps) @ p["q_up"]
    q = q.reshape(S, H, d)
    down = x_SD @ p["kv_down"]
    latent, k_rot = down[:, :cfg.kv_lora_rank], down[:, cfg.kv_lora_rank:]
    up = (rms_norm(latent, p["kv_down_norm"], eps) @ p["kv_up"]).reshape(S, H, d - r + dv)
    q_rot, k_rot = q[:, :, d - r:], k_rot.reshape(S, 1, r)
    if cfg.rope_interleave:
        q_rot, k_rot = (rope_pairs(t, cfg.rope_theta, positions, cfg) for t in (q_rot, k_rot))
    else:
        q_rot, k_rot = (rope(t, cfg.rope_theta, positions, r, cfg) for t in (q_rot, k_rot))
    q = torch.cat([q[:, :, :d - r], q_rot], dim=-1)
    k = torch.cat([up[:, :, :d - r], k_rot.expand(S, H, r)], dim=-1)
    return q, k, up[:, :, d - r:]


def attention(p, x_BSD, cfg, docs_BS=None, window=0):
    """Per sequence, head and position; query head h reads key/value head h // (H / KV).
    ``docs_BS``: a document id per position; a query reads only its document's keys at
    or before it, and positions restart at each document's first token. ``window``:
    query s reads only keys s - window + 1 .. s (0: all). ``p["sinks"]`` (when there):
    each head's sink logit, one more softmax term with no value. Multi-head latent
    attention (``cfg.kv_lora_rank``) through ``latent_heads``."""
    B, S, D = x_BSD.shape
    H, d = cfg.heads, cfg.head_dim
    outs = []
    for b in range(B):
        positions = None if docs_BS is None else document_positions(docs_BS[b].tolist())
        q, k, v = (latent_heads if cfg.kv_lora_rank else qkv_heads)(p, x_BSD[b], cfg, positions)
        KV = k.shape[1]
        o = torch.empty(S, H, v.shape[-1], dtype=x_BSD.dtype)
        for h in range(H):
            kv = h // (H // KV)
            for s in range(S):
                first = 0 if positions is None else s - positions[s]
                if window:
                    first = max(first, s - window + 1)
                logits = (k[first: s + 1, kv] @ q[s, h]) / math.sqrt(d) * yarn_softmax_gain(cfg)
                o[s, h] = sink_softmax(logits, p["sinks"][h] if "sinks" in p else None) @ v[first: s + 1, kv]
        outs.append(o.reshape(S, -1) @ p["out"] + (p["out_bias"] if "out_bias" in p else 0))
    return torch.stack(outs)


def sink_softmax(logits, sink=None):
    """softmax of ``logits`` with, if ``sink`` is given, one more logit whose weight is dropped."""
    top = logits.max() if sink is None else torch.maximum(logits.max(), sink)
    w = torch.exp(logits - top)
    total = w.sum() if sink is None else w.sum() + torch.exp(sink - top)
    return w / total


def glu_columns(width2, interleave):
    """Column indices of gate and up in an fc1 output of ``width2`` columns."""
    F = width2 // 2
    if not interleave:
        return list(range(F)), list(range(F, 2 * F))
    gate = [c for c in range(width2) if (c // interleave) % 2 == 0]
    up = [c for c in range(width2) if (c // interleave) % 2 == 1]
    return gate, up


def act(h, cfg):
    if cfg.activation == "relu2":
        return torch.where(h > 0, h * h, torch.zeros_like(h))
    gi, ui = glu_columns(h.shape[-1], cfg.glu_interleave)
    g, u = h[..., gi], h[..., ui]
    if cfg.activation == "swiglu":
        return g / (1 + torch.exp(-g)) * u
    if cfg.activation == "geglu":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    g = torch.minimum(g, torch.tensor(cfg.glu_limit, dtype=g.dtype))
    u = u.clamp(-cfg.glu_limit, cfg.glu_limit)
    return g / (1 + torch.exp(-1.702 * g)) * (u + cfg.glu_offset)


def route_token(p, x_D, cfg):
    """(experts, probs, scores) for one token."""
    logits = x_D @ p["router"]
    if "router_bias" in p:
        logits = logits + p["router_bias"]
    if cfg.score_func == "sigmoid":
        scores = 1 / (1 + torch.exp(-logits))
    else:
        e = torch.exp(logits - logits.max())
        scores = e / e.sum()
    by_logit = cfg.score_func == "topk_softmax"
    sel = ((logits if by_logit else scores) + p["expert_bias"]).tolist()
    chosen = sorted(allowed_experts(sel, cfg), key=lambda i: -sel[i])[: cfg.topk]
    probs = torch.stack([scores[i] for i in chosen])
    if by_logit:  # a softmax over the chosen logits alone
        top = torch.stack([logits[i] for i in chosen])
        probs = torch.exp(top - top.max()) / torch.exp(top - top.max()).sum()
    if cfg.norm_topk_prob:
        probs = probs / probs.sum()
    return chosen, probs * cfg.routed_scaling, scores


def allowed_experts(sel, cfg):
    """The experts of the ``topk_groups`` groups whose two best selection scores sum highest."""
    size = cfg.experts // cfg.expert_groups
    groups = [list(range(g * size, (g + 1) * size)) for g in range(cfg.expert_groups)]
    score = [sum(sorted((sel[i] for i in group), reverse=True)[:2]) for group in groups]
    best = sorted(range(cfg.expert_groups), key=lambda g: -score[g])[: cfg.topk_groups]
    return [i for g in best for i in groups[g]]


def moe(p, x_TD, cfg, capacity=None):
    """Per-token, per-expert loop. Returns (y, counts, aux_loss, z_loss).

    With ``capacity``, an expert serves only its first ``capacity`` assignments in
    token order; later ones are skipped (dropped)."""
    T = x_TD.shape[0]
    ex = p["experts"]
    ys, counts, score_rows = [], [0] * cfg.experts, []
    for t in range(T):
        chosen, probs, scores = route_token(p, x_TD[t], cfg)
        share = scores / scores.sum() if cfg.score_func == "sigmoid" else scores
        score_rows.append(share)
        y = torch.zeros_like(x_TD[t])
        for e, prob in zip(chosen, probs):
            counts[e] += 1
            if capacity is not None and counts[e] > capacity:
                continue
            h = x_TD[t] @ ex["fc1"][e]
            if "fc1_bias" in ex:
                h = h + ex["fc1_bias"][e]
            a = act(h, cfg)
            if cfg.prob_placement == "activation":
                out = (a * prob) @ ex["fc2"][e]
                if "fc2_bias" in ex:
                    out = out + ex["fc2_bias"][e]
                y = y + out
            else:
                out = a @ ex["fc2"][e]
                if "fc2_bias" in ex:
                    out = out + ex["fc2_bias"][e]
                y = y + prob * out
        if "shared" in p:
            shared = act(x_TD[t] @ p["shared"]["fc1"], cfg) @ p["shared"]["fc2"]
            if "gate" in p["shared"]:
                shared = shared / (1 + torch.exp(-(x_TD[t] @ p["shared"]["gate"])))
            y = y + shared
        ys.append(y)
    f = torch.tensor(counts, dtype=x_TD.dtype) / (T * cfg.topk)
    P = torch.stack(score_rows).mean(0)
    aux = cfg.experts * (f * P).sum()
    logits = x_TD @ p["router"] + (p["router_bias"] if "router_bias" in p else 0)
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return torch.stack(ys), torch.tensor(counts), aux, z


def lm_loss_sum(params, tokens_BS1, cfg, loss_mask_BS=None, segments_BS1=None):
    """Summed next-token cross-entropy and per-MoE-layer (aux, z) lists. Target j of a row
    counts where ``loss_mask[j]`` and, with segments, ``segments[j] == segments[j+1]``."""
    inputs, targets = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    B, S = inputs.shape
    docs = None if segments_BS1 is None else segments_BS1[:, :-1]
    h = params["embed"][inputs]
    aux, z = [], []
    for i, p in enumerate(params["layers"]):
        window = cfg.sliding_window if i in cfg.window_layers else 0
        h = h + attention(p["attn"], rms_norm(h, p["attn"]["norm"], cfg.norm_eps), cfg, docs, window)
        if "mlp" in p:  # a dense layer
            h = h + act(rms_norm(h, p["mlp"]["norm"], cfg.norm_eps) @ p["mlp"]["fc1"], cfg) @ p["mlp"]["fc2"]
            continue
        x = rms_norm(h, p["moe"]["norm"], cfg.norm_eps).reshape(B * S, -1)
        y, _, a, zz = moe(p["moe"], x, cfg)
        h = h + y.reshape(B, S, -1)
        aux.append(a)
        z.append(zz)
    head = params["embed"].T if cfg.tie_embeddings else params["head"]
    logits = rms_norm(h, params["final_norm"], cfg.norm_eps) @ head
    logp = logits - torch.logsumexp(logits, -1, keepdim=True)
    counts = torch.ones(B, S, dtype=torch.bool) if loss_mask_BS is None else loss_mask_BS.clone()
    if segments_BS1 is not None:
        counts &= segments_BS1[:, :-1] == segments_BS1[:, 1:]
    ce = -(logp.gather(-1, targets[..., None])[..., 0] * counts).sum()
    return ce, aux, z


# Comparing two pytrees: the structures first (a tree that is short a leaf, or
# holds another key, fails here instead of passing a shorter ``zip``), then leaf by leaf.

def assert_same_structure(a, b, context=""):
    """``a`` and ``b`` are trees of one structure (keys, node types and leaf count)."""
    sa, sb = optree.tree_structure(a), optree.tree_structure(b)
    assert sa == sb, f"{context}: tree structures differ: {sa} != {sb}" if context else f"{sa} != {sb}"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius norms, in float64): how far ``got`` is from
    ``want`` relative to its size (``want`` of all zeros: the absolute distance * 1e30)."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def assert_trees_close(a, b, context="", atol_of_scale: float | None = None, **tol):
    """Same tree structure, and every leaf of ``a`` close to its leaf in ``b``
    (``torch.testing.assert_close`` with ``tol``); ``context`` heads a failure's message.
    ``atol_of_scale``: each leaf's ``atol`` is this fraction of its largest magnitude in
    ``b`` (rounding that reorders a sum errs in proportion to the terms summed)."""
    assert_same_structure(a, b, context)
    for path, x, y in zip(optree.tree_paths(a), optree.tree_leaves(a), optree.tree_leaves(b)):
        leaf_tol = dict(tol, atol=atol_of_scale * float(y.abs().max())) if atol_of_scale is not None and y.numel() \
            else tol
        torch.testing.assert_close(x, y, **leaf_tol, msg=lambda m, path=path: f"{context} {path}: {m}".lstrip())


def assert_trees_equal(a, b, context=""):
    """Same tree structure, and ``torch.equal`` leaf by leaf; ``context`` heads a failure's message."""
    assert_same_structure(a, b, context)
    for path, x, y in zip(optree.tree_paths(a), optree.tree_leaves(a), optree.tree_leaves(b)):
        assert torch.equal(x, y), (context, path) if context else path
