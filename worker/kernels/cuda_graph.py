"""CUDA/HIP graphs of the target forward for short steps (decode rows and EAGLE verify trees).

A small model's step is launch-bound on a GPU; one graph per row-count bucket replays it as one launch, for decode
and tree rows alike (row limits live in static buffers). Whether a step replays depends
on its plan alone, so all ranks replay or none do. On CPU (tests) the same path runs uncaptured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.kernels.triton_attention import MAX_TREE_NODES, PagedRows, row_records
from worker.model.attention import AttentionMetadata
from worker.model.seq_slice import SeqSlice, slots_of


def capture_sizes(max_rows: int) -> tuple[int, ...]:
    """Row buckets: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond; max_rows last."""
    sizes = {1, 2, 4, 8} | set(range(16, 65, 8)) | set(range(80, 257, 16)) | set(range(288, max_rows + 1, 32))
    return tuple(sorted({s for s in sizes if s < max_rows} | {max_rows}))


def pick_bucket(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `rows`, or None when none does (the step runs eagerly)."""
    return next((s for s in sizes if s >= rows), None)


@dataclass(frozen=True)
class StepRows:
    """One step's per-row inputs, on the host, in the order the plan lists them."""

    ids: list[int]
    positions: list[int]
    slots: list[int]  # cache slot each row's K/V is written to
    seq: list[int]
    limit: list[int]
    tree_len: list[int]
    tree_mask: list[int]
    tables: list[list[int]]


def step_rows(ids: list[int], positions: list[int], slices: list[SeqSlice], block_size: int) -> StepRows:
    slots: list[int] = []
    for s in slices:
        slots += (
            s.tree.write_slots if s.tree else slots_of(s.block_table, range(s.ctx_len, s.ctx_len + s.q_len), block_size)
        )
    return StepRows(list(ids), list(positions), slots, *row_records(slices), [s.block_table for s in slices])


class StaticBuffers:
    """Device tensors sized for the largest bucket, filled in place each step: per row the token, position, cache
    slot and Triton row record; per sequence its block table. Rows past the step's n (up to the smallest bucket >=
    n) are padding, of sequence `max_seqs`, whose table names only the scratch block no sequence owns."""

    def __init__(
        self, max_rows: int, max_seqs: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device
    ):
        self.max_rows, self.max_seqs, self.max_blocks = max_rows, max_seqs, max_blocks
        self.scratch_slot, self.pad_seq = scratch_block * block_size, max_seqs
        self.block_size = block_size
        i32, i64 = {"dtype": torch.int32, "device": device}, {"dtype": torch.int64, "device": device}
        self.ids = torch.zeros(max_rows, **i64)
        self.positions = torch.zeros(max_rows, **i64)
        self.slots = torch.full((max_rows,), self.scratch_slot, **i64)
        self.seq = torch.full((max_rows,), self.pad_seq, **i32)
        self.limit = torch.ones(max_rows, **i32)
        self.tree_len = torch.zeros(max_rows, **i32)
        self.tree_mask = torch.zeros(max_rows, **i64)
        self.tables = torch.full((max_seqs + 1, max_blocks), scratch_block, **i32)

    def fits(self, rows: StepRows) -> bool:
        return (
            len(rows.ids) <= self.max_rows
            and len(rows.tables) <= self.max_seqs
            and all(len(t) <= self.max_blocks for t in rows.tables)
            and all(n <= MAX_TREE_NODES for n in rows.tree_len)
        )

    def fill(self, rows: StepRows, bucket: int) -> None:
        """Write one step into rows [0, bucket): its rows first, then padding (token 0 at position 0, writing and
        attending to the scratch slot alone). Block-table rows of sequences past this step keep stale entries
        that no row of this step reads."""
        pad = bucket - len(rows.ids)
        assert 0 <= pad and self.fits(rows), "the caller picks a bucket that holds the step"
        fields = (
            (self.ids, rows.ids, 0),
            (self.positions, rows.positions, 0),
            (self.slots, rows.slots, self.scratch_slot),
            (self.seq, rows.seq, self.pad_seq),
            (self.limit, rows.limit, 1),
            (self.tree_len, rows.tree_len, 0),
            (self.tree_mask, rows.tree_mask, 0),
        )
        for buf, values, padding in fields:
            host = torch.tensor(values + [padding] * pad, dtype=buf.dtype)
            buf[:bucket].copy_(host, non_blocking=True)
        width = max(len(t) for t in rows.tables)
        host = torch.zeros(len(rows.tables), width, dtype=torch.int32)
        for b, t in enumerate(rows.tables):
            host[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.tables[: len(rows.tables), :width].copy_(host, non_blocking=True)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Views of the first `bucket` rows: what the Triton path of `attend` reads (the slots to write, the row
        records and the tables); the reference path's fields are empty."""
        empty = torch.empty(0, dtype=torch.long, device=self.ids.device)
        paged = PagedRows(
            self.seq[:bucket], self.limit[:bucket], self.tree_len[:bucket], self.tree_mask[:bucket], self.tables
        )
        return AttentionMetadata(
            slot_mapping=self.slots[:bucket],
            kv_slots=empty,
            mask=empty,
            chunks=[],
            paged=paged,
            block_size=self.block_size,
        )


class GraphRunner:
    """The target forward over static buffers, one CUDA graph per bucket (or, with capture=False, the same forward
    called directly: the CPU test path)."""

    def __init__(self, model, kv: list, buffers: StaticBuffers, sizes: tuple[int, ...], capture: bool):
        self.model, self.kv, self.buf, self.sizes, self.capture = model, kv, buffers, sizes, capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.captured_aux: frozenset[int] | None = None  # the model's aux layers when the graphs were captured
        self.replays = 0  # steps that ran through the buffers (tests and /engine/stats read it)

    def _body(self, bucket: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(self.buf.ids[:bucket], self.buf.positions[:bucket], self.kv, self.buf.metadata(bucket))

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest bucket first, into one memory pool, so smaller graphs reuse its workspace; each runs twice
        eagerly first (Triton compiles, cuBLAS picks kernels). Captured at the first replayed step, not at load: a
        graph returns the hidden states it returned when captured, and EAGLE-3's aux layers are set after load."""
        self.graphs.clear()
        self.outputs.clear()
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.sizes, reverse=True):
            for _ in range(2):
                self._body(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._body(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self.captured_aux = frozenset(self.model.aux_layers)

    def bucket(self, rows: StepRows) -> int | None:
        return pick_bucket(len(rows.ids), self.sizes) if self.buf.fits(rows) else None

    def run(self, rows: StepRows, bucket: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """(hidden [n, h], aux hidden states, the slots written) for the step's n rows. On a GPU these are views of
        the graph's static outputs: the next replay overwrites them, so callers use them before the next step."""
        if self.capture and self.captured_aux != frozenset(self.model.aux_layers):
            self._capture()
        self.buf.fill(rows, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            hidden, aux = self.outputs[bucket]
        else:
            hidden, aux = self._body(bucket)
        self.replays += 1
        n = len(rows.ids)
        return hidden[:n], [a[:n] for a in aux], self.buf.slots[:n]
