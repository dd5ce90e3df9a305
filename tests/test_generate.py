"""Generation: the KV-cached path against full recomputation, sampling rules, the CLI."""

import sys

import pytest
import torch

import fmoe
from fmoe.generate import empty_cache, forward_cached, generate, main, sample_next
from fmoe.layers import forward

from . import reference as ref
from .procs import run_at_once

CFG = fmoe.ModelConfig(vocab=40, dim=32, layers=2, heads=4, kv_heads=2, qk_norm="head", experts=4, topk=2,
                       ffn=16, shared_ffn=8, shared_gate=True, tie_embeddings=True)


def params_of(cfg, seed=0):
    return ref.random_params(cfg, seed=seed, dtype=torch.float32)


def decoded_logits(params, tokens, cfg, prompt: int):
    """``(logits, cache)``: the first ``prompt`` tokens through the KV cache at once, then
    the rest one at a time, their logits concatenated (fp32, on the CPU)."""
    cache = empty_cache(cfg, tokens.shape[0], tokens.shape[1], torch.float32, "cpu")
    first, cache = forward_cached(params, tokens[:, :prompt], cfg, cache)
    steps = [first]
    for s in range(prompt, tokens.shape[1]):
        logits, cache = forward_cached(params, tokens[:, s:s + 1], cfg, cache)
        steps.append(logits)
    return torch.cat(steps, 1), cache


def test_cached_logits_equal_the_full_forward():
    params = params_of(CFG)
    tokens = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    full, _ = forward(params, tokens, CFG)
    logits, cache = decoded_logits(params, tokens, CFG, prompt=5)
    assert cache.length == 9
    # the same arithmetic in another grouping (one query row at a time): fp32 rounding only
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)


def test_greedy_generation_equals_argmax_of_recomputed_forward():
    params = params_of(CFG, seed=1)
    prompt = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(1))
    got = generate(params, prompt, CFG, max_new_tokens=12)
    ids = prompt
    for _ in range(12):  # no cache: the whole sequence again for every token
        logits, _ = forward(params, ids, CFG)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert got.shape == (2, 16) and torch.equal(got, ids)


def test_generation_stops_at_eos_and_is_deterministic_per_seed():
    params = params_of(CFG, seed=2)
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(params, prompt, CFG, 20, temperature=1.0, seed=7)
    assert torch.equal(a, generate(params, prompt, CFG, 20, temperature=1.0, seed=7))
    assert not torch.equal(a, generate(params, prompt, CFG, 20, temperature=1.0, seed=8))
    eos = int(a[0, 5])
    stopped = generate(params, prompt, CFG, 20, temperature=1.0, seed=7, eos_id=eos)
    assert stopped.shape[1] == 6 and torch.equal(stopped, a[:, :6])


def test_sampling_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0, -1.0]]).repeat(400, 1)
    assert sample_next(logits, g).eq(1).all()
    assert sample_next(logits, g, temperature=1.0, top_k=1).eq(1).all()
    assert set(sample_next(logits, g, temperature=1.0, top_k=2).tolist()) == {1, 2}
    probs = logits[0].softmax(-1)  # 0.55, 0.34, 0.07, ...: top_p=0.9 keeps three tokens, 0.5 one
    assert probs[1] + probs[2] < 0.9 < probs[1] + probs[2] + probs[3]
    assert set(sample_next(logits, g, temperature=1.0, top_p=0.9).tolist()) == {1, 2, 3}
    assert sample_next(logits, g, temperature=1.0, top_p=0.5).eq(1).all()
    assert set(sample_next(logits, g, temperature=1.0).tolist()) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kw,needle", [(dict(temperature=-1.0), "temperature=-1.0"), (dict(top_k=-2), "top_k=-2"),
                                       (dict(top_p=0.0), "top_p=0.0"), (dict(max_new_tokens=0), "max_new_tokens=0")])
def test_bad_sampling_settings_are_refused(kw, needle):
    args = dict(max_new_tokens=4) | kw
    with pytest.raises(ValueError, match=needle):
        generate(params_of(CFG), torch.tensor([[1, 2]]), CFG, **args)


def test_cli_samples_from_an_fmoe_checkpoint_and_a_hugging_face_directory(tmp_path):
    cfg = fmoe.ModelConfig(vocab=256, dim=32, heads=4, experts=4, ffn=16)
    plan = fmoe.Plan(model=cfg)
    params = fmoe.init(plan, seed=0)
    fmoe.save(tmp_path / "ck", plan, params, step=1)
    fmoe.hf.save(tmp_path / "hf", params, plan)
    *procs, bad = run_at_once(*[[sys.executable, "-m", "fmoe.generate", "--checkpoint", tmp_path / ck,
                                 "--prompt", "Hello", "--max-new-tokens", "8", "--temperature", "0"]
                                for ck in ("ck", "hf")],
                              [sys.executable, "-m", "fmoe.generate", "--checkpoint", tmp_path / "nope", "--prompt", "x"],
                              timeout=120)
    outs = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("Hello")
        outs.append(proc.stdout)
    assert outs[0] == outs[1]  # the same weights through either format
    assert bad.returncode != 0 and "fmoe.generate:" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cli_refuses_a_cuda_device_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match=r"fmoe.generate: --device='cuda', but CUDA is not available here"):
        main(["--checkpoint", str(tmp_path), "--prompt", "hi", "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"--device='gpu' is not a device"):
        main(["--checkpoint", str(tmp_path), "--prompt", "hi", "--device", "gpu"])
