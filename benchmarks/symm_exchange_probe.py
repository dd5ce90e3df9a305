"""What torch's NVSHMEM 2-D all-to-all does on this machine, before fmoe builds on it.

    source .device/setup.sh; torchrun --standalone --nproc-per-node 4 benchmarks/symm_exchange_probe.py

Rows permuted by global expert (rank-major: destination rank, then its local expert) go
to the ranks owning their experts with ``all_to_all_vdev_2d`` and come back with
``all_to_all_vdev_2d_offset``, split sizes on the device only. Checked against NCCL's
``all_to_all_single`` with the split sizes read on the host (fmoe's exchange today, put
expert-major by ``fmoe.layers.expert_parallel.expert_major``), on fresh random rows with
some empty experts; then the same again inside one CUDA graph, replayed on new rows; then
the two timed side by side at the qwen3-moe-medium microbatch's shape (median of 20).

The ops put rows into the peers' buffers and return once this rank's puts are done, not
once the peers' puts into this rank's buffer are: a rank reads what it received only after
a barrier with its peers (``landed``). Without it, a first run read stale rows.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm

from fmoe.layers.expert_parallel import expert_major


def say(*parts):
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def random_counts(P, El, rows, gen, device, shared=None):
    """Rows a rank sends to each (rank, local expert): skewed, with about a sixth empty;
    ``shared`` (a generator seeded alike on every rank) also empties some experts on every
    rank, so that no rank sends them a row."""
    weight = torch.rand(P * El, generator=gen) ** 3
    weight[torch.rand(P * El, generator=gen) < 0.17] = 0
    if shared is not None:
        weight[torch.rand(P * El, generator=shared) < 0.1] = 0
    counts = torch.distributions.Multinomial(rows, probs=weight / weight.sum()).sample().long()
    return counts.to(device)


def reference(x, counts, group):
    """Today's exchange: counts across, split sizes read on the host, rows across, expert-major."""
    P = group.size()
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    send_PE, recv_PE = counts.view(P, -1), recv.view(P, -1)
    send_splits, recv_splits = send_PE.sum(1).tolist(), recv_PE.sum(1).tolist()
    out = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(out, x[:sum(send_splits)], recv_splits, send_splits, group=group)
    order, _ = expert_major(recv_PE, out.shape[0])
    return out.index_select(0, order), recv_PE


def landed():
    """The peers' puts into this rank's buffers are done (see the module's note)."""
    torch.cuda.synchronize()
    dist.barrier()


def main():
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    say("torch", torch.__version__, "nvshmem available:", symm.is_nvshmem_available())
    symm.set_backend("NVSHMEM")
    group = dist.group.WORLD
    name = group.group_name
    El, D, T, K = 16, 1536, 8192, 8
    rows_in = T * K
    bound = P * T * min(K, El)
    t0 = time.perf_counter()
    inp = symm.empty(rows_in, D, dtype=torch.bfloat16, device=device)
    out = symm.empty(bound, D, dtype=torch.bfloat16, device=device)
    back = symm.empty(rows_in, D, dtype=torch.bfloat16, device=device)
    in_splits = symm.empty(P * El, dtype=torch.int64, device=device)
    out_so = symm.empty(2, P * El, dtype=torch.int64, device=device)
    back_so = symm.empty(2, P * El, dtype=torch.int64, device=device)
    for t in (inp, out, back, in_splits, out_so, back_so):
        symm.rendezvous(t, name)
    say(f"symmetric buffers: {(inp.numel() + out.numel() + back.numel()) * 2 / 2**30:.2f} GiB a rank, "
        f"allocated in {time.perf_counter() - t0:.2f} s")

    gen, shared = torch.Generator().manual_seed(1234 + rank), torch.Generator().manual_seed(99)
    bad = 0
    for trial in range(6):
        counts = random_counts(P, El, rows_in - 97 * trial, gen, device, shared)
        n = int(counts.sum())
        inp.normal_()
        want, recv_PE = reference(inp, counts, group)
        in_splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, name, major_align=1)
        landed()
        splits_EP, offsets_EP = out_so[0].view(El, P), out_so[1].view(El, P)
        real_EP = recv_PE.t()
        # the real rows, expert-major, wherever the op placed each (expert, source) block
        got = torch.cat([out[o:o + s] for o, s in zip(offsets_EP.reshape(-1).tolist(), real_EP.reshape(-1).tolist())])
        same = torch.equal(got, want)
        padded = (splits_EP != real_EP).sum().item()
        empty = (real_EP.sum(1) == 0).sum().item()
        contiguous = torch.equal(offsets_EP.reshape(-1)[1:], torch.cumsum(splits_EP.reshape(-1), 0)[:-1])
        # back, with the real splits: the op pads an empty expert's block to one row
        back_so.zero_()
        fixed = torch.stack([real_EP.reshape(-1), out_so[1]])
        out_so.copy_(fixed)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, name)
        landed()
        returned = torch.equal(back[:n], inp[:n])
        back_splits_ok = torch.equal(back_so[0], counts)
        bad += not (same and returned)
        say(f"trial {trial}: 2d rows equal the host-split exchange: {same}; blocks padded {padded}, empty experts "
            f"{empty}, offsets contiguous {contiguous}; rows back equal those sent: {returned}, back splits = "
            f"sent counts: {back_splits_ok}")
    flag = torch.tensor([bad], device=device)
    dist.all_reduce(flag)
    say("trials failing, summed over ranks:", int(flag))

    # one CUDA graph: 2-D exchange, a row-wise product, exchange back
    static_counts = torch.empty(P * El, dtype=torch.int64, device=device)

    def exchanged():  # no barrier fits inside a graph: the replay checks what the product reads
        in_splits.copy_(static_counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, name, major_align=1)
        out.mul_(2)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, name)

    graph_ok = "not tried"
    try:
        static_counts.copy_(random_counts(P, El, rows_in, gen, device))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            exchanged()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            exchanged()
        results = []
        for _ in range(3):
            counts = random_counts(P, El, rows_in, gen, device)
            n = int(counts.sum())
            static_counts.copy_(counts)
            inp.normal_()
            landed()
            graph.replay()
            landed()
            # padding rows double too: only a product that is row-wise stays right
            results.append(torch.equal(back[:n], inp[:n] * 2))
        failing = torch.tensor([sum(not r for r in results)], device=device)
        dist.all_reduce(failing)
        graph_ok = f"replays failing, summed over ranks: {int(failing)} of {3 * P}"
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        graph_ok = f"{type(e).__name__}: {str(e)[:300]}"
    say("CUDA graph of the 2-D exchange, a row-wise op and back, replayed on new splits:", graph_ok)

    # side by side: today's host-split exchange against the 2-D one, there and back
    counts = random_counts(P, El, rows_in, gen, device)
    inp.normal_()
    x = inp[:int(counts.sum())].clone()

    def nccl_round():
        rows, recv_PE = reference(x, counts, group)
        recv = recv_PE.sum(1).tolist()
        rows_back = rows.new_empty(x.shape[0], D)
        dist.all_to_all_single(rows_back, rows, counts.view(P, -1).sum(1).tolist(), recv, group=group)

    def symm_round():
        inp[:x.shape[0]].copy_(x)
        in_splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_so, name, major_align=1)
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_so, back_so, name)
        landed()

    for label, fn in (("nccl, host splits", nccl_round), ("nvshmem 2-D", symm_round)):
        times = []
        for i in range(25):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t)
        say(f"{label}: {statistics.median(times) * 1e3:.2f} ms there and back "
            f"({x.numel() * 2 / 2**20:.0f} MiB sent a rank each way)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
