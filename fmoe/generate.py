"""Sampling text from a trained model, with a KV cache.

    python -m fmoe.generate --checkpoint runs/fmoe-lm/checkpoint --prompt "def "
    python -m fmoe.generate --checkpoint ~/models/Qwen3-30B-A3B --prompt "The capital of France" \\
        --device cuda --dtype bfloat16 --temperature 0.7 --top-p 0.9

``--checkpoint`` is an fmoe checkpoint (``fmoe.save``) or a Hugging Face directory
(``fmoe.hf``). Text is tokenized with ``--tokenizer`` (a ``tokenizer.json``), else
with the tokenizer the checkpoint's run recorded (kept in its run folder and checked by
content; a ``tokenizer.json`` that merely lies nearby is never taken) or a Hugging Face
directory's own, else as UTF-8 bytes (a vocabulary of 256 or less). A ``--tokenizer``
that is not the checkpoint's own (by content: ``fmoe.data.tokenizer_match``) gets a
one-line warning on stderr: the model would read ids it was not trained on.

The model runs one token at a time after the prompt, reading keys and values of the
earlier positions from a cache instead of recomputing them (linear, not quadratic,
in the generated length).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

import optree
import torch

from .config import ModelConfig, Plan
from .layers.attention import KVSlot
from .layers.model import block, cast_for_compute, head_weight
from .layers.norm import rms_norm
from .runtime import device_memory, gib


class KVCache(NamedTuple):
    """Keys and values of the positions seen so far: per layer ``[B, K, max_len, d]`` key
    and ``[B, K, max_len, dv]`` value buffers (written in place as positions are added)
    and how many are filled. Under multi-head latent attention every head's key and
    value are cached (``K = heads``), not the latent."""

    keys: list
    values: list
    length: int


def kv_cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of the keys and values of ``max_len`` positions of ``batch`` rows."""
    per_position = cfg.num_kv_heads * (cfg.head_dim + cfg.v_head_dim)
    return cfg.layers * batch * per_position * max_len * dtype.itemsize


def empty_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
    def buffers(width: int) -> list:
        return [torch.empty(batch, cfg.num_kv_heads, max_len, width, dtype=dtype, device=device)
                for _ in range(cfg.layers)]
    return KVCache(buffers(cfg.head_dim), buffers(cfg.v_head_dim), 0)


@torch.no_grad()
def forward_cached(params: dict, tokens_BS: torch.Tensor, cfg: ModelConfig, cache: KVCache):
    """Logits of ``tokens`` continuing the cached positions; their keys and values are
    written into the cache's buffers.

    Arguments:
        params: the full params pytree in the compute dtype.
        tokens_BS: ``[B, S]`` the next token ids (the prompt, then one at a time).
        cfg: the ModelConfig (routing is dropless here whatever ``capacity_factor`` says).
        cache: from ``empty_cache`` or the previous call.

    Returns:
        ``(logits_BSV, cache)`` with the cache's length advanced by ``S``.
    """
    start, S = cache.length, tokens_BS.shape[1]
    if start + S > cache.keys[0].shape[2]:
        raise ValueError(f"generate: {start + S} positions exceed the cache's max_len {cache.keys[0].shape[2]}")
    dropless = cfg.replace(capacity_factor=0.0, pad_multiple=0)
    h = params["embed"][tokens_BS]
    for i, p in enumerate(params["layers"]):
        h, _ = block(p, h, dropless, kv=KVSlot(cache.keys[i], cache.values[i], start), layer=i)
    logits = rms_norm(h, params["final_norm"], cfg.norm_eps) @ head_weight(params)
    return logits, cache._replace(length=start + S)


def sample_next(logits_BV: torch.Tensor, generator: torch.Generator | None, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The next token of each row: greedy at ``temperature=0``, else sampled from the
    softmax at that temperature, restricted to the ``top_k`` likeliest tokens (0: all)
    and to the smallest set whose probability reaches ``top_p`` (nucleus)."""
    logits = logits_BV.float()
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int, seed: int = 0) -> None:
    if not (temperature >= 0 and temperature != float("inf")):
        raise ValueError(f"generate temperature={temperature!r} is invalid: must be a finite number >= 0 (0: greedy)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"generate top_k={top_k!r} is invalid: must be an int >= 0 (0: no limit)")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate top_p={top_p!r} is invalid: must be in (0, 1]")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate max_new_tokens={max_new_tokens!r} is invalid: must be an int >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"generate seed={seed!r} is invalid: must be an int in 0..{2**63 - 1}")


@torch.no_grad()
def generate(params: dict, prompt_BS: torch.Tensor, cfg: ModelConfig, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Continue each prompt row by up to ``max_new_tokens`` tokens.

    Arguments:
        params: the full fp32 params pytree (``fmoe.gather_full`` of a sharded one).
        prompt_BS: ``[B, S]`` token ids on the params' device.
        cfg: the ModelConfig.
        max_new_tokens, temperature, top_k, top_p: see ``sample_next``.
        seed: sampling is deterministic per seed.
        eos_id: stop once every row has produced it.
        dtype: compute dtype.

    Returns:
        ``[B, S + n]`` the prompts and their continuations (``n <= max_new_tokens``).
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens, seed)
    check_prompt(prompt_BS, cfg)
    B, S = prompt_BS.shape
    check_cache(cfg, B, S, max_new_tokens, dtype, prompt_BS.device)
    compute = cast_for_compute(params, dtype)
    cache = empty_cache(cfg, B, S + max_new_tokens, dtype, prompt_BS.device)
    generator = torch.Generator().manual_seed(seed)
    out, finished = [prompt_BS], torch.zeros(B, dtype=torch.bool, device=prompt_BS.device)
    logits, cache = forward_cached(compute, prompt_BS, cfg, cache)
    for _ in range(max_new_tokens):
        token = sample_next(logits[:, -1], generator, temperature, top_k, top_p)
        out.append(token[:, None])
        if eos_id is not None:
            finished |= token == eos_id
            if bool(finished.all()):
                break
        if len(out) - 1 == max_new_tokens:
            break
        logits, cache = forward_cached(compute, token[:, None], cfg, cache)
    return torch.cat(out, dim=1)


def check_cache(cfg: ModelConfig, batch: int, prompt_len: int, max_new_tokens: int, dtype: torch.dtype,
                device) -> None:
    """ValueError naming ``max_new_tokens`` when the KV cache could not fit ``device``."""
    need, have = kv_cache_bytes(cfg, batch, prompt_len + max_new_tokens, dtype), device_memory(device)
    if need > have:
        raise ValueError(f"generate max_new_tokens={max_new_tokens} is invalid: the KV cache of {batch} row(s) x "
                         f"{prompt_len + max_new_tokens} positions needs {gib(need)}, but {device} has {gib(have)}")


def check_prompt(prompt_BS, cfg: ModelConfig) -> None:
    """ValueError naming the prompt unless it is ``[batch, length >= 1]`` integer ids
    below ``cfg.vocab``, on a device that holds data."""
    if not isinstance(prompt_BS, torch.Tensor):
        raise ValueError(f"generate: the prompt must be a tensor of token ids, got {type(prompt_BS).__name__}")
    if prompt_BS.dtype.is_floating_point or prompt_BS.dtype.is_complex or prompt_BS.dtype == torch.bool:
        raise ValueError(f"generate: the prompt must hold integer token ids (torch.long), got {prompt_BS.dtype}")
    if prompt_BS.dim() != 2 or prompt_BS.shape[0] == 0 or prompt_BS.shape[1] == 0:
        raise ValueError("generate: the prompt must be a [batch >= 1, length >= 1] tensor of ids, "
                         f"got {list(prompt_BS.shape)}")
    if prompt_BS.device.type == "meta":
        raise ValueError("generate: the prompt is on the meta device, which holds no values; pass real ids")
    if int(prompt_BS.min()) < 0 or int(prompt_BS.max()) >= cfg.vocab:
        raise ValueError(f"generate: prompt ids must be in 0..{cfg.vocab - 1}")


class Tokenizer(NamedTuple):
    """Text <-> ids: a Hugging Face ``tokenizer.json`` or UTF-8 bytes (``path`` None)."""

    encode: object
    decode: object
    path: Path | None


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer in ``path`` (a tokenizer.json), or byte-level when ``path`` is None."""
    if path is None:
        return Tokenizer(lambda text: list(text.encode("utf-8")),
                         lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"), None)
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise ValueError(f"{path}: reading a tokenizer.json needs the tokenizers package "
                         "(pip install 'fmoe[data]')") from None
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own exception type
        raise ValueError(f"{path}: not a readable tokenizer.json ({err})") from None
    return Tokenizer(lambda text: tok.encode(text).ids, lambda ids: tok.decode(list(ids)), Path(path))


def is_fmoe_checkpoint(checkpoint: Path) -> bool:
    """An fmoe checkpoint (``fmoe.save``) rather than a Hugging Face directory."""
    return (checkpoint / "fmoe.json").exists() or not (checkpoint / "config.json").exists()


def checkpoint_tokenizer(checkpoint) -> Path | None:
    """The tokenizer a checkpoint's text goes through: a Hugging Face directory's own
    ``tokenizer.json``; for an fmoe checkpoint, the one its run recorded
    (``fmoe.data.recorded_tokenizer``), never one that merely lies beside it. None: UTF-8
    bytes (a vocabulary of 256 or less with no tokenizer)."""
    from . import hf
    from .checkpoint import read_meta
    from .data import recorded_tokenizer

    checkpoint = Path(checkpoint)
    if is_fmoe_checkpoint(checkpoint):
        _, meta = read_meta(checkpoint)
        return recorded_tokenizer(checkpoint, meta.get("extra", {}), int(meta["model"]["vocab"]))
    if (checkpoint / "tokenizer.json").is_file():
        return checkpoint / "tokenizer.json"
    vocab = hf.config(checkpoint).vocab
    if vocab > 256:
        raise ValueError(f"{checkpoint} has no tokenizer.json and a vocab of {vocab}, so its ids are not bytes: "
                         "name its tokenizer.json")
    return None


def foreign_tokenizer(tokenizer, checkpoint) -> str | None:
    """The warning ``python -m fmoe.generate`` prints when ``--tokenizer`` is not the
    checkpoint's own tokenizer (``checkpoint_tokenizer``; the same content digest), or
    None when it is, or when the checkpoint names none to compare with."""
    from .data.tokenizer_match import describe, same_tokenizer, tokenizer_digest

    try:
        own = checkpoint_tokenizer(checkpoint)
    except ValueError:  # no tokenizer of its own on record: --tokenizer is the only one there is
        return None
    if same_tokenizer(tokenizer, own):
        return None
    theirs = " (its ids are UTF-8 bytes)" if own is None else f", {describe(own, tokenizer_digest(own))}"
    return (f"fmoe.generate: warning: --tokenizer {describe(tokenizer, tokenizer_digest(tokenizer))} is not "
            f"{checkpoint}'s own tokenizer{theirs}; the model reads ids it was not trained on")


class Loaded(NamedTuple):
    params: dict
    cfg: ModelConfig
    eos_id: int | None  # the end-of-text token the checkpoint names, if any


def load_model(checkpoint, device: str = "cpu") -> Loaded:
    """Full params, config and end-of-text id of an fmoe checkpoint (``extra["eos_id"]``)
    or a Hugging Face directory (``eos_token_id`` of its config.json). A checkpoint of
    adapters (a ``--lora-rank`` run's) is merged into its base, the Hugging Face folder its
    run's ``settings.toml`` names (``init_from_hf``)."""
    from . import hf, lora
    from .checkpoint import load, read_config, read_lora
    from .hf.export import check_source, run_source

    checkpoint = Path(checkpoint)
    if is_fmoe_checkpoint(checkpoint):
        cfg = read_config(checkpoint)
        plan = Plan(model=cfg, device=device, lora=read_lora(checkpoint))
        ck = load(checkpoint, plan)
        if plan.lora is None:
            return Loaded(ck.params, cfg, ck.extra.get("eos_id"))
        source = run_source(checkpoint)
        if source is None:
            raise ValueError(f"{checkpoint} holds adapters, whose base model its run's settings.toml does not name: "
                             "export the merged model (python -m fmoe.hf export CKPT --out DIR --source HF_DIR) "
                             "and generate from it")
        check_source(source, cfg, f"the base {source} (the run's init_from_hf)")
        base = hf.load(source, plan.replace(lora=None))
        return Loaded(lora.merge(base, ck.params, plan), cfg, ck.extra.get("eos_id"))
    cfg = hf.config(checkpoint)
    eos = json.loads((checkpoint / "config.json").read_text()).get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return Loaded(hf.load(checkpoint, Plan(model=cfg, device=device)), cfg, eos if isinstance(eos, int) else None)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(prog="python -m fmoe.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="an fmoe checkpoint or a Hugging Face model directory")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the one the checkpoint's run "
                                                      "recorded, a Hugging Face directory's own, else bytes)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    from . import hf
    from .checkpoint import read_config

    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens, args.seed)
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device={args.device!r} is not a device (allowed: cpu, cuda, cuda:N)") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device={args.device!r}, but CUDA is not available here (allowed: cpu)")
        checkpoint = Path(args.checkpoint)
        tokenizer = load_tokenizer(args.tokenizer or checkpoint_tokenizer(checkpoint))
        if args.tokenizer and (warning := foreign_tokenizer(args.tokenizer, checkpoint)):
            print(warning, file=sys.stderr)
        prompt = torch.tensor([tokenizer.encode(args.prompt)], device=args.device)
        if prompt.numel() == 0:
            raise ValueError("generate: --prompt is empty")
        cfg = read_config(checkpoint) if is_fmoe_checkpoint(checkpoint) else hf.config(checkpoint)
        check_cache(cfg, 1, prompt.shape[1], args.max_new_tokens, getattr(torch, args.dtype), device)
        # read in fp32 on the host, cast, then moved: the device holds the model once, in --dtype
        model = load_model(checkpoint, "cpu")
        params = optree.tree_map(lambda t: t.to(args.device),
                                 cast_for_compute(model.params, getattr(torch, args.dtype)))
        ids = generate(params, prompt, model.cfg, args.max_new_tokens, args.temperature, args.top_k,
                       args.top_p, args.seed, model.eos_id, dtype=getattr(torch, args.dtype))
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"fmoe.generate: {err}") from None
    text = tokenizer.decode(ids[0].tolist())
    print(text)
    return text


if __name__ == "__main__":
    main()
