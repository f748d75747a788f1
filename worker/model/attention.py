"""Paged KV cache and masked attention over a ragged batch: `attend(q, k, v, cache, meta)`.

Short steps (decode, tree verification) attend row by row over gathered keys; long chunks (prefill) run torch SDPA
per sequence with a mask, or, where the fused CPU kernels run, the same row-wise kernel over one shared key list, so
a position gets the same bits whether it is prefilled in any chunk, hit in the prefix cache, decoded or verified. No
sequence's numbers depend on another's. On CPU the arithmetic is float32 (bfloat16 SDPA is 4-5x slower for decode);
the cache is bfloat16 where fused kernels run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.kernels import cpu as cpu_kernels
from worker.kernels.triton_attention import paged_rows, triton_attend
from worker.model.seq_slice import SeqSlice


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] where each new token's K/V is written
    kv_slots: torch.Tensor | None  # [B, L] cache slot of each key position (None: every row attends row-wise, fused)
    mask: torch.Tensor | None  # [B, 1, T, L] bool: which keys each query row may see
    chunks: list[tuple[int, int, int, int]]  # sequences that attend as a chunk: (index, first query row, rows, keys)
    row_index: torch.Tensor | None = None  # [R] the query rows that attend row-wise (sequences of short chunks)
    row_kv_slots: torch.Tensor | None = None  # [R, Lr] each such row's own keys, in order, padded at the end
    row_bias: torch.Tensor | None = None  # [R, 1, Lr] float: 0 for real keys, -inf for padding
    row_counts: torch.Tensor | None = None  # [R] how many of each row's keys are real
    row_gather: dict | None = None  # per KV-head count: flat (slot, head) indices and the bias, built once a step
    paged: object | None = None  # triton backend: per-row PagedRows (worker/kernels/triton_attention.py)
    block_size: int = 16


# Row-wise attention (decode, verify, short chunks): each query row attends over a gather of exactly its own keys,
# in position order, padded at the end to a multiple of ROW_KEY_BUCKET, through batched matmuls whose per-row
# arithmetic does not depend on the batch (torch's CPU SDPA does: it splits work by batch size). A row's result then
# depends only on its own keys, so a token verified inside an EAGLE tree gets the same bits as the same token
# decoded alone, and a request's output does not depend on the batch it shares. A verify tree always attends row-wise,
# whatever its size; a chunk of more than ROW_WISE_MAX_Q causal rows attends as a chunk.
ROW_WISE_MAX_Q = 16
ROW_KEY_BUCKET = 64


def _row_wise(s: SeqSlice) -> bool:
    """Whether a sequence's rows attend row-wise this step: a verify tree always, a causal chunk up to 16 rows."""
    return s.tree is not None or s.q_len <= ROW_WISE_MAX_Q


def _row_keys(mask: torch.Tensor, kv_slots: torch.Tensor, q_valid: torch.Tensor):
    """mask [B, T, L] -> (slots [N, Lr], valid [N, Lr]) for the N real query rows."""
    m = mask[q_valid]  # [N, L]
    slots = kv_slots.unsqueeze(1).expand(mask.shape)[q_valid]
    counts = m.sum(-1)
    width = -(-int(counts.max()) // ROW_KEY_BUCKET) * ROW_KEY_BUCKET
    if width > m.shape[1]:
        pad = width - m.shape[1]
        m = torch.nn.functional.pad(m, (0, pad))
        slots = torch.nn.functional.pad(slots, (0, pad))
    order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)[:, :width]  # real keys first, in order
    valid = torch.arange(width).unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(valid, slots.gather(1, order), torch.zeros_like(order)), valid


def build_attention_metadata(
    seqs: list[SeqSlice], block_size: int, device: torch.device, backend: str = "torch"
) -> AttentionMetadata:
    if backend == "torch" and all(_row_wise(s) for s in seqs) and cpu_kernels.ops(device) is not None:
        return _fused_row_metadata(seqs, block_size)
    B = len(seqs)
    q_lens = torch.tensor([s.q_len for s in seqs])
    ctx = torch.tensor([s.ctx_len for s in seqs])
    extra = torch.tensor([len(s.tree.key_slots) if s.tree else s.q_len for s in seqs])
    kv_lens = ctx + extra
    T, L = int(q_lens.max()), int(kv_lens.max())
    max_blocks = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(B, max_blocks, dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    kpos = torch.arange(L)
    kv_slots = tables[:, (kpos // block_size).clamp(max=max_blocks - 1)] * block_size + kpos % block_size  # [B, L]
    key_valid = kpos.unsqueeze(0) < kv_lens.unsqueeze(1)
    kv_slots = torch.where(key_valid, kv_slots, torch.zeros_like(kv_slots))

    t = torch.arange(T)
    q_valid = t.unsqueeze(0) < q_lens.unsqueeze(1)  # [B, T]
    starts = torch.cumsum(q_lens, 0) - q_lens
    qpos = ctx.unsqueeze(1) + t  # [B, T]
    slot_mapping = kv_slots.gather(1, qpos.clamp(max=L - 1))[q_valid]

    mask = (kpos.view(1, 1, L) <= qpos.unsqueeze(2)) & key_valid.unsqueeze(1)  # causal within each row
    trees = [i for i, s in enumerate(seqs) if s.tree is not None]
    if trees:
        slot_mapping = slot_mapping.clone()
        offsets = starts.tolist()
        for i in trees:
            s = seqs[i]
            c, e = s.ctx_len, len(s.tree.key_slots)
            kv_slots[i, c : c + e] = torch.tensor(s.tree.key_slots, dtype=torch.long)
            mask[i, :, :c] = True
            mask[i, : s.q_len, c : c + e] = s.tree.mask
            mask[i, :, c + e :] = False
            slot_mapping[offsets[i] : offsets[i] + s.q_len] = torch.tensor(s.tree.write_slots, dtype=torch.long)
    short = torch.tensor([_row_wise(s) for s in seqs])  # each sequence's path depends on its own step, not its mates'
    rows = bool(short.any())
    if rows:
        row_q = q_valid & short.unsqueeze(1)
        row_slots, row_valid = _row_keys(mask, kv_slots, row_q)
        row_index = torch.arange(int(q_lens.sum())).masked_select(short.repeat_interleave(q_lens))
    paged = None
    if backend == "triton":
        paged = paged_rows(seqs, device)
    return AttentionMetadata(
        paged=paged,
        block_size=block_size,
        slot_mapping=slot_mapping.to(device),
        kv_slots=kv_slots.to(device),
        mask=mask.unsqueeze(1).to(device),
        chunks=[
            (i, start, q_len, kv_len)
            for i, (start, q_len, kv_len, row) in enumerate(
                zip(starts.tolist(), q_lens.tolist(), kv_lens.tolist(), short.tolist())
            )
            if not row
        ],
        row_index=None if not rows else row_index.to(device),
        row_kv_slots=None if not rows else row_slots.to(device),
        row_bias=None
        if not rows
        else torch.zeros(row_valid.shape).masked_fill(~row_valid, float("-inf")).unsqueeze(1).to(device),
        row_counts=None if not rows else row_valid.sum(-1).to(device),
    )


def _fused_row_metadata(seqs: list[SeqSlice], block_size: int) -> AttentionMetadata:
    """Decode and verify steps for the fused kernel: each row's key slots in order and how many are real, built
    straight from the block tables (no masks: the kernel reads only a row's own keys)."""
    rows: list[torch.Tensor] = []
    counts: list[int] = []
    writes: list[torch.Tensor] = []
    for s in seqs:
        table = torch.tensor(s.block_table, dtype=torch.long)
        known = s.ctx_len if s.tree else s.ctx_len + s.q_len
        pos = torch.arange(known)
        slots = table[pos // block_size] * block_size + pos % block_size
        if s.tree is None:  # causal: every row reads a prefix of the same list
            writes.append(slots[s.ctx_len :])
            rows += [slots] * s.q_len
            counts += range(s.ctx_len + 1, known + 1)
            continue
        keys = torch.tensor(s.tree.key_slots, dtype=torch.long)
        writes.append(torch.tensor(s.tree.write_slots, dtype=torch.long))
        for r in range(s.q_len):  # the context, then the row's ancestors and itself
            own = keys[s.tree.mask[r]]
            rows.append(torch.cat([slots, own]))
            counts.append(s.ctx_len + len(own))
    n = len(counts)
    return AttentionMetadata(
        slot_mapping=torch.cat(writes),
        kv_slots=None,
        mask=None,
        chunks=[],
        row_index=torch.arange(n),
        row_kv_slots=torch.nn.utils.rnn.pad_sequence(rows, batch_first=True),
        row_counts=torch.tensor(counts, dtype=torch.long),
        block_size=block_size,
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, Hkv, D] for the new tokens. Writes k, v into the cache, returns [N, H, D]."""
    dtype = q.dtype
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    q = q.to(k_cache.dtype)
    if meta.paged is not None:
        return triton_attend(q, k_cache, v_cache, meta.paged, meta.block_size, scale).to(dtype)
    every_row = meta.row_index is not None and meta.row_index.numel() == q.shape[0]
    if every_row:
        return _attend_rows(q, k_cache, v_cache, meta, scale).to(dtype)
    out = torch.empty_like(q)
    if meta.row_index is not None:
        rows = _attend_rows(q.index_select(0, meta.row_index), k_cache, v_cache, meta, scale)
        out.index_copy_(0, meta.row_index, rows)
    _attend_chunks(q, k_cache, v_cache, meta, scale, out)
    return out.to(dtype)


def attend_rotated(
    kernels,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The fused CPU path, after `kernels.rope_write_cache` has rotated q (float32 [N, H, D]) and written k, v: every
    row attends in the fused row-wise kernel, short steps over their own key lists, each long chunk's causal rows
    over prefixes of its one list. Returns [N, H, D] in dtype."""
    rows = meta.row_index
    if rows is not None and rows.numel() == q.shape[0]:  # decode and verify: every row in one call
        return kernels.attend_rows(q, k_cache, v_cache, meta.row_kv_slots, meta.row_counts, scale, dtype)
    covered = (0 if rows is None else rows.numel()) + sum(q_len for _, _, q_len, _ in meta.chunks)
    if covered != q.shape[0]:
        raise ValueError(f"attention metadata covers {covered} of {q.shape[0]} rows (built for another backend?)")
    out = torch.empty(q.shape, dtype=dtype)
    if rows is not None:
        out.index_copy_(
            0,
            rows,
            kernels.attend_rows(
                q.index_select(0, rows), k_cache, v_cache, meta.row_kv_slots, meta.row_counts, scale, dtype
            ),
        )
    for i, start, q_len, kv_len in meta.chunks:
        counts = torch.arange(kv_len - q_len + 1, kv_len + 1)  # row t sees the keys up to its own position
        keys = meta.kv_slots[i : i + 1, :kv_len]
        out[start : start + q_len] = kernels.attend_rows(
            q[start : start + q_len], k_cache, v_cache, keys, counts, scale, dtype
        )
    return out


def _attend_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Long chunks (prefill): one SDPA per sequence, so a sequence's numbers do not depend on its batch-mates."""
    for i, start, q_len, kv_len in meta.chunks:
        slots = meta.kv_slots[i, :kv_len]
        kp = k_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, Hkv, kv_len, D]
        vp = v_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        qp = q[start : start + q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=meta.mask[i : i + 1, :, :q_len, :kv_len], scale=scale, enable_gqa=True
        )
        out[start : start + q_len] = o[0].transpose(0, 1)


def _row_gather(meta: AttentionMetadata, hkv: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into a cache viewed as [slots * hkv, D] that gather [N, hkv, Lr, D] in one index_select, and the
    padding bias laid out to match; the same for every layer, so built once a step."""
    cached = meta.row_gather.get((hkv, dtype)) if meta.row_gather is not None else None
    if cached is None:
        N, width = meta.row_kv_slots.shape
        heads = torch.arange(hkv, device=meta.row_kv_slots.device).view(1, hkv, 1)
        index = (meta.row_kv_slots.unsqueeze(1) * hkv + heads).reshape(-1)
        if meta.row_bias is None:  # metadata built for the fused kernels, which read only the counts
            real = torch.arange(width, device=index.device).unsqueeze(0) < meta.row_counts.unsqueeze(1)
            meta.row_bias = torch.zeros(real.shape, device=index.device).masked_fill(~real, float("-inf")).unsqueeze(1)
        bias = meta.row_bias.to(dtype).unsqueeze(1).expand(N, hkv, 1, width).reshape(N * hkv, 1, width)
        cached = (index, bias)
        meta.row_gather = (meta.row_gather or {}) | {(hkv, dtype): cached}
    return cached


def _attend_rows(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    N, H, D = q.shape
    width = meta.row_kv_slots.shape[1]
    hkv = k_cache.shape[1]
    index, bias = _row_gather(meta, hkv, k_cache.dtype)  # GPU caches hold the model dtype
    kp = k_cache.view(-1, D).index_select(0, index).view(N * hkv, width, D)
    vp = v_cache.view(-1, D).index_select(0, index).view(N * hkv, width, D)
    qp = q.reshape(N * hkv, H // hkv, D)  # query heads grouped by the KV head they share
    scores = torch.baddbmm(bias, qp, kp.transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1), vp).view(N, H, D)
