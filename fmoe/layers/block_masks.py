"""FlexAttention's block masks: packed documents (``Documents``: ids, positions inside
each document and, on CUDA, the document block masks every layer reads) and plain causal
rows with an optional sliding window (``row_block_mask``: worked out from the block grid,
no ``[S, S]`` mask, cached per length, window and device)."""

import functools
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask


class Documents(NamedTuple):
    """The packed documents of a microbatch's rows, as attention needs them.

    Attributes:
        ids_BS: ``[B, S]`` document id of each input position (non-decreasing along a row).
        positions_BS: ``[B, S]`` each position's index inside its document (RoPE's position).
        block_mask: on CUDA, FlexAttention's BlockMask of "same document, at or before"
            (built once per microbatch, read by every layer); None elsewhere.
        window_mask: on CUDA with a sliding window, the BlockMask of the windowed
            layers (``block_mask`` within the window); None elsewhere.
    """

    ids_BS: torch.Tensor
    positions_BS: torch.Tensor
    block_mask: object | None = None
    window_mask: object | None = None

    def mask_for(self, window: int):
        """The BlockMask of a layer with ``window`` (0: none), or None off CUDA."""
        return self.window_mask if window else self.block_mask


def documents(ids_BS: torch.Tensor, window: int = 0) -> Documents:
    """Documents of rows whose positions carry the ids ``ids_BS`` (``[B, S]``, each
    document one run of equal ids); ``window``: the model's sliding window
    (``ModelConfig.sliding_window`` when a layer uses one, else 0)."""
    B, S = ids_BS.shape
    index = torch.arange(S, device=ids_BS.device).expand(B, S)
    first = torch.ones_like(ids_BS, dtype=torch.bool)
    first[:, 1:] = ids_BS[:, 1:] != ids_BS[:, :-1]
    starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
    block_mask = _document_block_mask(ids_BS) if ids_BS.is_cuda else None
    window_mask = _document_block_mask(ids_BS, window) if ids_BS.is_cuda and window else None
    return Documents(ids_BS, index - starts, block_mask, window_mask)


def _document_block_mask(ids_BS: torch.Tensor, window: int = 0):
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (ids_BS[b, q] == ids_BS[b, kv]) & (kv <= q)

    def same_document_window(b, h, q, kv):
        return same_document_causal(b, h, q, kv) & (kv > q - window)

    B, S = ids_BS.shape
    mask_mod = same_document_window if window else same_document_causal
    # compiled, the mask is worked out without a [B, S, S] tensor: 7% of the coarse
    # shape's step faster than eager (benchmarks/packed_rows.py)
    return create_block_mask(mask_mod, B, None, S, S, device=ids_BS.device, _compile=True)


# FlexAttention's default sparse block (create_block_mask's BLOCK_SIZE): the row masks
# below are built on its grid
_BLOCK = 128

def row_mask_mod(window: int):
    """FlexAttention's mask_mod of a plain row: key ``kv`` at or before query ``q``, and
    within ``window`` keys of it when ``window`` > 0."""
    if not window:
        return _causal_mask_mod

    def causal_window(b, h, q, kv):
        return (kv <= q) & (kv > q - window)

    return causal_window


def _causal_mask_mod(b, h, q, kv):
    return kv <= q


@functools.cache
def row_mask_parts(S: int, window: int, device: torch.device) -> tuple:
    """The tensors of the BlockMask of plain causal rows of length ``S`` (``window``: 0
    or the sliding window), as ``create_block_mask`` would make them for
    ``row_mask_mod(window)``, but from block arithmetic: no ``[S, S]`` mask is ever
    made (create_block_mask's eager path makes one; compiled, it is a graph per length
    and window, and past the recompile limit it would fall back to the eager one).

    A query block ``[q0, q1]`` and a key block ``[k0, k1]`` hold the distances
    ``q - kv`` from ``q0 - k1`` to ``q1 - k0``; the block is seen when some of them
    lie in ``[0, W)`` (``[0, inf)`` without window) and full when all do and neither
    block is cut short by the row's end (create_block_mask pads past ``S`` with False,
    so a cut block is never full).

    Returns:
        ``(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)``, each
        ``[1, 1, n(, n)]`` int32 for ``n = ceil(S / 128)`` blocks.
    """
    first_N = torch.arange(0, S, _BLOCK, device=device)
    last_N = (first_N + _BLOCK).clamp(max=S) - 1
    q_first, q_last, k_first, k_last = first_N[:, None], last_N[:, None], first_N[None, :], last_N[None, :]
    whole_N = last_N - first_N + 1 == _BLOCK  # not cut short by the row's end
    seen_NN = q_last - k_first >= 0
    full_NN = (q_first - k_last >= 0) & whole_N[:, None] & whole_N[None, :]
    if window:
        seen_NN = seen_NN & (q_first - k_last < window)
        full_NN = full_NN & (q_last - k_first < window)
    partial_NN = seen_NN & ~full_NN

    def ordered(blocks_NN):  # create_block_mask's order: each row's blocks first, ascending
        blocks_11NN = blocks_NN[None, None].to(torch.int32)
        indices = torch.argsort(blocks_11NN, dim=-1, descending=True, stable=True)
        return blocks_11NN.sum(-1).to(torch.int32), indices.to(torch.int32)

    mask = BlockMask.from_kv_blocks(*ordered(partial_NN), *ordered(full_NN), BLOCK_SIZE=_BLOCK,
                                    mask_mod=row_mask_mod(window), seq_lengths=(S, S))
    return (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
            mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)


@torch.compiler.assume_constant_result
def _row_mask_constants(S: int, window: int, device: torch.device) -> tuple:
    # Compiled (Plan.compile's attention region), dynamo calls this while tracing and
    # takes the cached tensors as constants of the graph: the mask is neither traced
    # (it would be rebuilt on every call, in every layer) nor a graph break. Eager, a
    # plain call of the cache.
    return row_mask_parts(S, window, device)


def row_block_mask(S: int, window: int, device: torch.device):
    """FlexAttention's BlockMask of plain causal rows of length ``S`` (with ``window``
    > 0: only the last ``window`` keys), its tensors built once per (S, window, device)
    (``row_mask_parts``)."""
    (kv_num, kv_indices, full_kv_num, full_kv_indices,
     q_num, q_indices, full_q_num, full_q_indices) = _row_mask_constants(S, window, device)
    return BlockMask(seq_lengths=(S, S), kv_num_blocks=kv_num, kv_indices=kv_indices,
                     full_kv_num_blocks=full_kv_num, full_kv_indices=full_kv_indices, q_num_blocks=q_num,
                     q_indices=q_indices, full_q_num_blocks=full_q_num, full_q_indices=full_q_indices,
                     BLOCK_SIZE=(_BLOCK, _BLOCK), mask_mod=row_mask_mod(window))
