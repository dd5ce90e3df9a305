"""Bad inputs across the public surface: each is refused with its error type and a
message naming the field and what is allowed, before anything runs or is written.

Every case is one row of ``CASES``: ``(id, call, error, needle)``. ``call(ctx)`` does the
bad thing with the fixtures of ``ctx`` (a small model's params, a batch, a scratch
folder, a checkpoint made on demand); the error must be ``error`` and its message must
contain ``needle``. After it, every file under the test's folder must be as it was just
before the bad call (a case that sets files up, or damages a checkpoint on purpose,
calls ``ctx.baseline()`` when done) and the params passed in must be bitwise unchanged.
Adding a case is adding a row.
"""

import json
import os
from typing import NamedTuple

import optree
import pytest
import torch

import fmoe
from fmoe.generate import generate, main as generate_main
from fmoe.optim import apply_if_finite
from fmoe.train import main as train_main
from interop import MoELayer

CFG = fmoe.ModelConfig(vocab=32, dim=32, heads=2, experts=4, ffn=16)
PLAN = fmoe.Plan(model=CFG)


class Ctx:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.params = fmoe.init(PLAN, seed=0)
        self.batch = {"tokens": torch.arange(36).reshape(4, 9) % 32}  # ids 0..31
        self.scratch = tmp_path / "scratch"
        self.scratch.mkdir()
        self._ckpt = None
        self.baseline()

    def baseline(self):
        """Record the files as they are: the bad call must leave them so."""
        self.files_before = self.files()

    def files(self) -> dict:
        return {str(p.relative_to(self.tmp)): p.read_bytes() if p.is_file() else "dir"
                for p in sorted(self.tmp.rglob("*"))}

    def checkpoint(self):
        """A good checkpoint of ``params`` and an AdamW state, saved on first use."""
        if self._ckpt is None:
            self._ckpt = self.tmp / "ck"
            fmoe.save(self._ckpt, PLAN, self.params, opt_state=fmoe.adamw().init(self.params), step=3)
            self.baseline()
        return self._ckpt

    def with_leaf(self, path, value):
        """A copy of the params pytree with the leaf at ``path`` replaced (or added)."""
        params = optree.tree_map(lambda t: t, self.params)
        node = params
        *parents, last = path
        for key in parents:
            node = node[key]
        node[last] = value
        return params

    def without_leaf(self, key):
        return {k: v for k, v in self.params.items() if k != key}


def _damaged(ctx, damage):
    """Load a checkpoint after ``damage(path)`` changed it on purpose."""
    path = ctx.checkpoint()
    damage(path)
    ctx.baseline()
    return fmoe.load(path, PLAN)


def _meta_edit(**changes):
    def damage(path):
        meta = json.loads((path / "fmoe.json").read_text())
        (path / "fmoe.json").write_text(json.dumps(dict(meta, **changes)))
    return damage


def _meta_garbage(path):
    (path / "fmoe.json").write_text('{"format": 2, "model": {')


def _flip_a_data_byte(path):
    data = sorted(path.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _save_over_foreign(ctx):
    (ctx.scratch / "notes.txt").write_text("mine")
    ctx.baseline()
    return fmoe.save(ctx.scratch, PLAN, ctx.params)


class ForeignState(NamedTuple):
    x: torch.Tensor


def _step(params, batch, plan=PLAN):
    return fmoe.step(params, batch, plan)


def _train(ctx, *flags):
    return train_main([*map(str, flags), "--out", str(ctx.scratch / "run")])


V = ValueError
NAN, INF = float("nan"), float("inf")
ADAM_STATES = "['ApplyIfFiniteState', 'ClipState', 'EmptyState', 'ScaleByAdamState', 'ScheduleState']"
CASES = [
    # ModelConfig
    ("model.dim", lambda c: CFG.replace(dim=0), V, "ModelConfig.dim=0 is invalid: must be an int >= 1"),
    ("model.vocab_bool", lambda c: CFG.replace(vocab=True), V,
     "ModelConfig.vocab=True is invalid: must be an int >= 1"),
    ("model.activation", lambda c: CFG.replace(activation="gelu"), V,
     "ModelConfig.activation='gelu' is invalid: allowed: 'swiglu', 'geglu', 'quick_geglu', 'relu2'"),
    ("model.topk", lambda c: CFG.replace(topk=5), V, "ModelConfig.topk=5 is invalid: must be <= experts (4)"),
    ("model.heads", lambda c: CFG.replace(heads=3), V, "ModelConfig.dim=32 is invalid: must be divisible by heads (3)"),
    ("model.kv_heads", lambda c: CFG.replace(heads=4, kv_heads=3), V,
     "ModelConfig.kv_heads=3 is invalid: must divide heads (4), or be 0"),
    ("model.head_size", lambda c: CFG.replace(head_size=7), V,
     "ModelConfig.head_size=7 is invalid: the head size must be even"),
    ("model.qk_norm", lambda c: CFG.replace(qk_norm="layer"), V,
     "ModelConfig.qk_norm='layer' is invalid: allowed: 'none', 'head', 'full'"),
    ("model.shared_gate", lambda c: CFG.replace(shared_gate=True), V,
     "ModelConfig.shared_gate=True is invalid: needs a shared expert (shared_ffn > 0)"),
    ("model.tie_embeddings", lambda c: CFG.replace(tie_embeddings=1), V,
     "ModelConfig.tie_embeddings=1 is invalid: must be True or False"),
    ("model.capacity_factor", lambda c: CFG.replace(capacity_factor=-1.0), V,
     "ModelConfig.capacity_factor=-1.0 is invalid: must be a finite number >= 0"),
    # Plan
    ("plan.sharding", lambda c: fmoe.Plan(model=CFG, sharding="zero3"), V,
     "Plan.sharding='zero3' is invalid: allowed: 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'"),
    ("plan.schedule", lambda c: fmoe.Plan(model=CFG, schedule="gpipe"), V,
     "Plan.schedule='gpipe' is invalid: allowed: 'standard', '1f1b_overlap'"),
    ("plan.dp", lambda c: fmoe.Plan(model=CFG, dp=0), V, "Plan.dp=0 is invalid: must be an int >= 1"),
    ("plan.ep", lambda c: fmoe.Plan(model=CFG, ep=3), V, "Plan.ep=3 is invalid: must divide model.experts (4)"),
    ("plan.dtype", lambda c: fmoe.Plan(model=CFG, dtype="float16"), V,
     "Plan.dtype='float16' is invalid: allowed: 'float32', 'bfloat16'"),
    ("plan.prefetch", lambda c: fmoe.Plan(model=CFG, prefetch=2, gather_buffers="double"), V,
     "Plan.prefetch=2 is invalid: gather_buffers='double' holds 2 units, so prefetch must be 0 or 1"),
    ("plan.units_tied", lambda c: fmoe.Plan(model=CFG.replace(tie_embeddings=True),
                                            units=(("embed",), ("layers.0", "layers.1"), ("head",))),
     V, "Plan.units must put 'embed' and 'head' in one unit when model.tie_embeddings=True"),
    # batches (fmoe.step)
    ("batch.key", lambda c: _step(c.params, {"ids": c.batch["tokens"]}), V,
     "batch must be a dict with 'tokens': LongTensor[B, S+1]"),
    ("batch.dtype", lambda c: _step(c.params, {"tokens": c.batch["tokens"].int()}), V,
     "batch['tokens'] must be a LongTensor[B, S+1], got torch.int32 [4, 9]"),
    ("batch.dims", lambda c: _step(c.params, {"tokens": c.batch["tokens"][None]}), V,
     "batch['tokens'] must be a LongTensor[B, S+1], got torch.int64 [1, 4, 9]"),
    ("batch.columns", lambda c: _step(c.params, {"tokens": c.batch["tokens"][:, :1]}), V,
     "batch['tokens'] has 1 column(s); it needs S+1 >= 2"),
    ("batch.range", lambda c: _step(c.params, {"tokens": c.batch["tokens"] + 40}), V,
     "batch['tokens'] holds ids in [40, 71]; allowed: 0..31"),
    ("batch.rows", lambda c: _step(c.params, c.batch, PLAN.replace(microbatches=3)), V,
     "batch['tokens'] has 4 rows, which Plan.microbatches=3 does not divide (allowed: a positive multiple of 3)"),
    ("batch.meta_device", lambda c: _step(c.params, {"tokens": c.batch["tokens"].to("meta")}), V,
     "batch['tokens'] is on the meta device, which holds no values"),
    # fine-tuning batches: loss_mask and segments (DESIGN.md "Fine-tuning batches")
    ("batch.unknown_key", lambda c: _step(c.params, dict(c.batch, labels=c.batch["tokens"])), V,
     "batch has unknown key 'labels'; allowed keys: 'tokens', 'loss_mask', 'segments'"),
    ("batch.loss_mask_dtype", lambda c: _step(c.params, dict(c.batch, loss_mask=torch.ones(4, 8))), V,
     "batch['loss_mask'] must be a BoolTensor[B, S] = [4, 8] (True: the target counts), got torch.float32 [4, 8]"),
    ("batch.loss_mask_shape", lambda c: _step(c.params, dict(c.batch, loss_mask=torch.ones(4, 9, dtype=torch.bool))),
     V, "batch['loss_mask'] must be a BoolTensor[B, S] = [4, 8]"),
    ("batch.segments_dtype", lambda c: _step(c.params, dict(c.batch, segments=torch.zeros(4, 9))), V,
     "batch['segments'] must be an integer tensor [B, S+1] = [4, 9] (a document id per position), got "
     "torch.float32 [4, 9]"),
    ("batch.segments_shape", lambda c: _step(c.params, dict(c.batch, segments=torch.zeros(4, 8, dtype=torch.long))),
     V, "batch['segments'] must be an integer tensor [B, S+1] = [4, 9]"),
    ("batch.segments_negative", lambda c: _step(c.params, dict(c.batch, segments=torch.full((4, 9), -1))), V,
     "batch['segments'] holds a negative document id (-1); allowed: ids >= 0"),
    ("batch.segments_decreasing",
     lambda c: _step(c.params, dict(c.batch, segments=torch.arange(9).flip(0).expand(4, 9))), V,
     "batch['segments'] decreases along a row; allowed: document ids non-decreasing along each row"),
    ("batch.no_counted_target",
     lambda c: _step(c.params, dict(c.batch, loss_mask=torch.zeros(4, 8, dtype=torch.bool))), V,
     "batch['loss_mask'] (with 'segments') leaves no counted target in the global batch"),
    ("batch.every_position_its_own_document",
     lambda c: _step(c.params, dict(c.batch, segments=torch.arange(9).expand(4, 9))), V,
     "leaves no counted target in the global batch"),
    # tensors handed to the other public functions, checked against the config
    ("expert_bias.counts_experts", lambda c: fmoe.update_expert_bias(c.params, torch.ones(2, 3), 0.01), V,
     "update_expert_bias expert_counts has shape [2, 3] and dtype torch.float32; these params need [layers=2, "
     "experts=4]"),
    ("expert_bias.counts_layers", lambda c: fmoe.update_expert_bias(c.params, torch.ones(1, 4, dtype=torch.long),
                                                                    0.01), V,
     "update_expert_bias expert_counts has shape [1, 4] and dtype torch.int64; these params need [layers=2"),
    ("expert_bias.counts_list", lambda c: fmoe.update_expert_bias(c.params, [3, 1, 0, 0], 0.01), V,
     "update_expert_bias expert_counts must be a tensor [layers=2, experts=4] (out.metrics['expert_counts']), got "
     "list"),
    ("moe_layer.int_input", lambda c: MoELayer(CFG)(torch.ones(3, 32, dtype=torch.long)), V,
     "MoELayer input must be a float tensor [..., dim=32] of hidden states, got torch.int64 [3, 32]"),
    ("generate.float_prompt", lambda c: generate(c.params, torch.ones(1, 3), CFG, 4), V,
     "generate: the prompt must hold integer token ids (torch.long), got torch.float32"),
    ("generate.kv_cache", lambda c: generate(c.params, c.batch["tokens"], CFG, 10**12), V,
     "generate max_new_tokens=1000000000000 is invalid: the KV cache of 4 row(s) x 1000000000009 positions needs"),
    ("generate.seed", lambda c: generate(c.params, c.batch["tokens"], CFG, 4, seed=10**23), V,
     "generate seed=100000000000000000000000 is invalid: must be an int in 0..9223372036854775807"),
    ("generate.cli_max_new_tokens", lambda c: generate_main(["--checkpoint", str(c.checkpoint()), "--prompt", "a",
                                                             "--max-new-tokens", "1000000000"]), SystemExit,
     "fmoe.generate: generate max_new_tokens=1000000000 is invalid: the KV cache of 1 row(s) x 1000000001 "
     "positions needs"),
    # params (fmoe.step)
    ("params.shape", lambda c: _step(c.with_leaf(["head"], torch.zeros(32, 31)), c.batch), V,
     "params['head'] has shape [32, 31]; this rank's part under the plan is [32, 32]"),
    ("params.dtype", lambda c: _step(c.with_leaf(["embed"], c.params["embed"].double()), c.batch), V,
     "params['embed'] has dtype torch.float64; params are float32"),
    ("params.missing", lambda c: _step(c.without_leaf("final_norm"), c.batch), V,
     "params do not match Plan.model's layout; differing leaves: ['final_norm']"),
    ("params.extra", lambda c: _step(c.with_leaf(["bonus"], torch.zeros(3)), c.batch), V,
     "params do not match Plan.model's layout; differing leaves: ['bonus']"),
    ("params.other_model", lambda c: _step(c.params, c.batch, fmoe.Plan(model=CFG.replace(qk_norm="head"))), V,
     "differing leaves: ['layers.0.attn.k_norm'"),
    # optimizer settings (checked when the optimizer is built)
    ("optim.lr_inf", lambda c: fmoe.adamw(lr=INF), V,
     "adamw lr=inf is invalid: must be a finite number > 0 or a schedule"),
    ("optim.lr_zero", lambda c: fmoe.adamw(lr=0.0), V, "adamw lr=0.0 is invalid: must be a finite number > 0"),
    ("optim.lr_bool", lambda c: fmoe.adamw(lr=True), V, "adamw lr=True is invalid: must be a finite number > 0"),
    ("optim.lr_str", lambda c: fmoe.adamw(lr="1e-3"), V, "adamw lr='1e-3' is invalid: must be a finite number > 0"),
    ("optim.b1_nan", lambda c: fmoe.adamw(b1=NAN), V, "adamw b1=nan is invalid: must be in [0, 1)"),
    ("optim.b2_one", lambda c: fmoe.adamw(b2=1.0), V, "adamw b2=1.0 is invalid: must be in [0, 1)"),
    ("optim.eps_zero", lambda c: fmoe.adamw(eps=0.0), V, "adamw eps=0.0 is invalid: must be a finite number > 0"),
    ("optim.weight_decay_negative", lambda c: fmoe.adamw(weight_decay=-0.1), V,
     "adamw weight_decay=-0.1 is invalid: must be a finite number >= 0"),
    ("optim.weight_decay_nan", lambda c: fmoe.adamw(weight_decay=NAN), V,
     "adamw weight_decay=nan is invalid: must be a finite number >= 0"),
    ("optim.max_grad_norm_zero", lambda c: fmoe.adamw(max_grad_norm=0.0), V,
     "adamw max_grad_norm=0.0 is invalid: must be a finite number > 0, or None (no clipping)"),
    ("optim.max_grad_norm_inf", lambda c: fmoe.adamw(max_grad_norm=INF), V,
     "adamw max_grad_norm=inf is invalid: must be a finite number > 0, or None"),
    ("optim.skip_nonfinite_negative", lambda c: fmoe.adamw(skip_nonfinite=-1), V,
     "adamw skip_nonfinite=-1 is invalid: must be an int >= 0 (0: off)"),
    ("optim.skip_nonfinite_bool", lambda c: fmoe.adamw(skip_nonfinite=True), V,
     "adamw skip_nonfinite=True is invalid: must be an int >= 0"),
    ("optim.fused", lambda c: fmoe.adamw(fused=1), V, "adamw fused=1 is invalid: must be True or False"),
    ("optim.expert_bias_donate", lambda c: fmoe.update_expert_bias(c.params, torch.ones(2, 4), 0.01, donate=1), V,
     "update_expert_bias donate=1 is invalid: must be True or False"),
    ("optim.max_skips_zero", lambda c: apply_if_finite(fmoe.scale_by_adam(), 0), V,
     "apply_if_finite max_skips=0 is invalid: must be an int >= 1"),
    ("optim.max_skips_float", lambda c: apply_if_finite(fmoe.scale_by_adam(), 2.0), V,
     "apply_if_finite max_skips=2.0 is invalid: must be an int >= 1"),
    ("optim.clip_max_norm", lambda c: fmoe.clip_by_global_norm(0.0), V,
     "clip_by_global_norm max_norm=0.0 is invalid: must be a finite number > 0"),
    ("optim.adam_b1", lambda c: fmoe.scale_by_adam(b1=-0.1), V, "scale_by_adam b1=-0.1 is invalid: must be in [0, 1)"),
    ("optim.adam_eps", lambda c: fmoe.scale_by_adam(eps=INF), V,
     "scale_by_adam eps=inf is invalid: must be a finite number > 0"),
    ("optim.lr_transform", lambda c: fmoe.optim.scale_by_learning_rate(-1e-3), V,
     "scale_by_learning_rate lr=-0.001 is invalid: must be a finite number > 0 or a schedule"),
    ("optim.decay_transform", lambda c: fmoe.optim.add_decayed_weights(-1.0), V,
     "add_decayed_weights weight_decay=-1.0 is invalid: must be a finite number >= 0"),
    ("schedule.peak", lambda c: fmoe.warmup_cosine(INF, warmup=1, total=10), V,
     "warmup_cosine peak=inf is invalid: must be a finite number > 0"),
    ("schedule.warmup", lambda c: fmoe.warmup_cosine(1e-3, warmup=-1, total=10), V,
     "warmup_cosine warmup=-1 is invalid: must be an int >= 0"),
    ("schedule.total", lambda c: fmoe.warmup_cosine(1e-3, warmup=0, total=0), V,
     "warmup_cosine total=0 is invalid: must be an int >= 1"),
    ("schedule.floor", lambda c: fmoe.warmup_cosine(1e-3, warmup=1, total=10, floor=2.0), V,
     "warmup_cosine floor=2.0 is invalid: must be in [0, 1]"),
    # checkpoints: fmoe.load
    ("ckpt.missing", lambda c: fmoe.load(c.tmp / "nope", PLAN), FileNotFoundError,
     "no fmoe checkpoint at"),
    ("ckpt.meta_garbage", lambda c: _damaged(c, _meta_garbage), V, "fmoe.json is unreadable"),
    ("ckpt.format", lambda c: _damaged(c, _meta_edit(format=99)), V, "checkpoint format 99, this fmoe reads 2"),
    ("ckpt.checksum", lambda c: _damaged(c, _flip_a_data_byte), V, "is corrupted (checksum mismatch)"),
    ("ckpt.other_model", lambda c: fmoe.load(c.checkpoint(), fmoe.Plan(model=CFG.replace(ffn=32))), V,
     "model config differs from Plan.model: ffn: checkpoint 16, plan 32"),
    # checkpoints: fmoe.save
    ("ckpt.save_step", lambda c: fmoe.save(c.scratch / "x", PLAN, c.params, step=-3), V,
     "save: step=-3 is invalid: must be an int in 0..9223372036854775807"),
    ("ckpt.save_extra", lambda c: fmoe.save(c.scratch / "x", PLAN, c.params, extra={"f": object()}), V,
     "save: extra must be JSON-serialisable"),
    ("ckpt.save_over_foreign", _save_over_foreign, V, "exists and is not an fmoe checkpoint; refusing to replace it"),
    ("ckpt.save_params", lambda c: fmoe.save(c.scratch / "x", PLAN, c.with_leaf(["head"], torch.zeros(3, 3))), V,
     "params['head'] has shape [3, 3]; this rank's part under the plan is [32, 32]"),
    ("ckpt.save_other_model", lambda c: fmoe.save(c.scratch / "x", fmoe.Plan(model=CFG.replace(ffn=32)), c.params),
     V, "params['layers.0.moe.experts.fc1'] has shape [4, 32, 32]; this rank's part under the plan is [4, 32, 64]"),
    ("ckpt.save_opt_state_leaf", lambda c: fmoe.save(c.scratch / "x", PLAN, c.params, opt_state=(object(),)), V,
     "save: cannot save opt_state 'opt_state.0' of type object; allowed: tensors, dicts, lists, tuples"),
    ("ckpt.save_opt_state_type", lambda c: fmoe.save(c.scratch / "x", PLAN, c.params,
                                                     opt_state=ForeignState(torch.zeros(()))), V,
     f"save: cannot save opt_state 'opt_state' of type ForeignState; allowed NamedTuple states: {ADAM_STATES}"),
    # the main job's command line and config files
    ("cli.activation", lambda c: _train(c, "--activation", "tanh"), SystemExit,
     "ModelConfig.activation='tanh' is invalid"),
    ("cli.steps", lambda c: _train(c, "--steps", 0), SystemExit, "--steps=0 is invalid: must be an int >= 1"),
    ("cli.heldout_fraction", lambda c: _train(c, "--heldout-fraction", 1.5), SystemExit,
     "--heldout-fraction=1.5 is invalid: must be in (0, 1)"),
    ("cli.timeout", lambda c: _train(c, "--timeout", 0), SystemExit,
     "--timeout=0.0 is invalid: must be a finite number > 0"),
    ("cli.keep", lambda c: _train(c, "--keep", 0), SystemExit, "--keep=0 is invalid: must be an int >= 1"),
    ("cli.cuda_graph", lambda c: _train(c, "--cuda-graph", "mlp"), SystemExit,
     "--cuda-graph='mlp' is invalid: 'step', or"),
    ("cli.resume", lambda c: _train(c, "--resume"), SystemExit, "--resume, but there is no checkpoint"),
    ("cli.init_from_hf", lambda c: _train(c, "--init-from-hf", c.tmp / "nohf"), SystemExit, "no config.json"),
    # numbers that crashed, hung or tried to allocate what no machine has
    ("cli.threads", lambda c: _train(c, "--threads", 100000), SystemExit,
     f"--threads=100000 is invalid: must be an int in 0..{os.cpu_count()} (this machine's cores"),
    ("cli.steps_huge", lambda c: _train(c, "--steps", 10**31), SystemExit,
     f"--steps={10**31} is invalid: must be an int in 1..9223372036854775807"),
    ("cli.seed_huge", lambda c: _train(c, "--seed", 10**23), SystemExit,
     f"--seed={10**23} is invalid: must be an int in 0..9223372036854775807"),
    ("cli.seed_negative", lambda c: _train(c, "--seed", -1), SystemExit, "--seed=-1 is invalid: must be an int >= 0"),
    ("cli.timeout_huge", lambda c: _train(c, "--timeout", 1e12), SystemExit,
     "--timeout=1000000000000.0 is invalid: must be at most 31536000 seconds (a year)"),
    ("cli.model_too_big", lambda c: _train(c, "--dim", 10**6), SystemExit,
     "fmoe.train: the model (--dim, --layers, --experts, --ffn, --vocab) needs at least"),
    ("cli.batch_too_big", lambda c: _train(c, "--batch", 2**40), SystemExit,
     "fmoe.train: the batch (--batch, --seq, --microbatches) needs at least"),
    ("cli.sample_tokens_huge", lambda c: _train(c, "--sample-tokens", 10**12), SystemExit,
     "--sample-tokens=1000000000000 is invalid: its KV cache needs"),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("call,error,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_naming_the_field_before_any_work(tmp_path, call, error, needle):
    ctx = Ctx(tmp_path)
    before = optree.tree_map(torch.clone, ctx.params)
    with pytest.raises(error) as err:
        call(ctx)
    assert needle in str(err.value)
    assert ctx.files() == ctx.files_before, "a file was written or changed before the error"
    assert optree.tree_structure(ctx.params) == optree.tree_structure(before)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(optree.tree_leaves(ctx.params),
                                                                 optree.tree_leaves(before)))


def test_there_are_at_least_thirty_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 30
