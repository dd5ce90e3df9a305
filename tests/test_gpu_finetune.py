"""Fine-tuning batches on a GPU: FlexAttention's document path against the exact
masked path, packed against separate rows, compiled and CUDA-graphed steps."""

import optree
import pytest
import torch

import fmoe
from fmoe.layers import attend, documents

from .reference import assert_trees_close, assert_trees_equal
from .test_finetune import PLAIN, fine_tuning_batch, packed_and_separate

pytestmark = pytest.mark.gpu

MODEL = fmoe.ModelConfig(vocab=64, dim=128, layers=2, heads=4, kv_heads=2, experts=4, topk=2, ffn=64,
                         aux_loss_coef=0.0)


def on_gpu(batch):
    return {k: v.cuda() for k, v in batch.items()}


def random_documents(B, S, docs, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.zeros(B, S, dtype=torch.long)
    for b in range(B):
        cuts[b, torch.randperm(S - 1, generator=g)[:docs - 1] + 1] = 1
    return cuts.cumsum(1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_document_attention_equals_the_exact_masked_path_and_the_float64_cpu_one(dtype, tol):
    B, H, K, S, d = 2, 4, 2, 320, 64  # S not a multiple of the 128-token block
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n, S, d, generator=g) for n in (H, K, K))
    ids = random_documents(B, S, docs=7)
    grad = torch.randn(B, S, H * d, generator=g)

    def run(device, dt, flex):
        xs = [t.to(device, dt).requires_grad_() for t in (q, k, v)]
        docs = documents(ids.to(device))
        if not flex:
            docs = docs._replace(block_mask=None)
        assert (docs.block_mask is not None) == flex
        out = attend(*xs, docs=docs)
        out.backward(grad.to(device, dt))
        return [out.detach().double().cpu()] + [x.grad.double().cpu() for x in xs]

    want = run("cpu", torch.float64, flex=False)
    flex = run("cuda", dtype, flex=True)
    exact = run("cuda", dtype, flex=False)
    for f, e, w in zip(flex, exact, want):
        scale = w.abs().max()
        assert (f - w).abs().max() <= tol * scale
        assert (e - w).abs().max() <= tol * scale


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_packed_rows_equal_separate_rows_on_the_gpu(compile):
    params = fmoe.init(fmoe.Plan(model=PLAIN), seed=3)
    packed, separate = packed_and_separate()
    plan = fmoe.Plan(model=PLAIN, device="cuda", compile=compile)
    gpu_params = optree.tree_map(lambda t: t.cuda(), params)
    got = fmoe.step(gpu_params, on_gpu(packed), plan)
    want = fmoe.step(gpu_params, on_gpu(separate), plan.replace(compile=False))
    cpu = fmoe.step(params, packed, fmoe.Plan(model=PLAIN))
    # fp32 on the GPU: TF32 is off by default for matmuls; attention kernels reassociate
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.loss.cpu(), cpu.loss, rtol=1e-5, atol=0)
    assert_trees_close(got.grads, want.grads, rtol=1e-3, atol=1e-5)


def test_compiled_packed_steps_hold_after_the_attention_graph_went_dynamic():
    # Head sizes and row counts changing through one process's compiled attention make
    # its dims dynamic; FlexAttention's kernel then still gets its scale as a number,
    # and 8-feature heads (under Flex's 16) take the masked path.
    packed, _ = packed_and_separate()
    for heads in (1, 2, 4):
        cfg = PLAIN.replace(heads=heads, kv_heads=heads)
        plan = fmoe.Plan(model=cfg, device="cuda", compile=True)
        params = optree.tree_map(lambda t: t.cuda(), fmoe.init(fmoe.Plan(model=cfg), seed=3))
        for rows in (4, 2):
            batch = on_gpu({k: v[:rows] for k, v in packed.items()})
            got = fmoe.step(params, batch, plan)
            want = fmoe.step(params, batch, plan.replace(compile=False))
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=0)


def test_a_whole_step_graph_reads_each_batchs_mask_segments_and_count():
    from interop.cuda_graph import capture_step
    cfg = MODEL.replace(capacity_factor=2.0)
    plan = fmoe.Plan(model=cfg, dtype="bfloat16", device="cuda")
    params = fmoe.init(plan, seed=0)
    first = on_gpu(fine_tuning_batch(B=4, S=128, vocab=64, seed=0))
    graphed = capture_step(params, first, plan)
    for seed in (1, 2):
        batch = on_gpu(fine_tuning_batch(B=4, S=128, vocab=64, seed=seed))
        out = graphed(params, batch)
        eager = fmoe.step(params, batch, plan)
        assert out.metrics["tokens"] == eager.metrics["tokens"]
        assert torch.equal(out.loss, eager.loss)
        assert_trees_equal(out.grads, eager.grads)
