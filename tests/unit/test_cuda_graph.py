"""Graph-capture bookkeeping without a GPU: bucket choice, static buffers, padding rows, and when a step falls back
to eager. The capture itself is run by the `cuda` tests (tests/kernels/test_cuda.py) on the device check."""

from __future__ import annotations

import torch

from worker.kernels.cuda_graph import GraphRunner, StaticBuffers, capture_sizes, pick_bucket, step_rows
from worker.model.seq_slice import SeqSlice, TreeKeys, slots_of

BS = 4


def test_buckets_cover_every_row_count_up_to_the_largest():
    sizes = capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and 64 in sizes and 80 in sizes
    assert capture_sizes(5) == (1, 2, 4, 5) and capture_sizes(1) == (1,)
    assert all(pick_bucket(n, sizes) >= n for n in range(1, 257))
    assert pick_bucket(3, sizes) == 4 and pick_bucket(65, sizes) == 80 and pick_bucket(257, sizes) is None
    assert capture_sizes(300)[-2:] == (288, 300)


def _step():
    """A decode row (context 5) and a 3-node verify tree (context 9: root, its child, a second child)."""
    decode = SeqSlice(5, 1, [7, 3])
    write = slots_of([2, 8, 6], range(9, 12), BS)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    tree = SeqSlice(9, 3, [2, 8, 6], TreeKeys(write, write, mask))
    return step_rows([11, 12, 13, 14], [5, 9, 10, 10], [decode, tree], BS)


def test_static_buffers_hold_the_step_then_padding_on_the_scratch_block():
    rows = _step()
    assert rows.slots == [3 * BS + 1, 6 * BS + 1, 6 * BS + 2, 6 * BS + 3]
    assert rows.limit == [6, 9, 9, 9] and rows.tree_len == [0, 3, 3, 3] and rows.tree_mask == [0, 1, 3, 5]
    buf = StaticBuffers(
        max_rows=8, max_seqs=4, max_blocks=6, scratch_block=50, block_size=BS, device=torch.device("cpu")
    )
    buf.fill(rows, 8)
    assert buf.ids.tolist() == [11, 12, 13, 14, 0, 0, 0, 0]
    assert buf.positions.tolist() == [5, 9, 10, 10, 0, 0, 0, 0]
    assert buf.slots.tolist() == rows.slots + [200] * 4  # padding writes the scratch block's first slot only
    assert buf.seq.tolist() == [0, 1, 1, 1, 4, 4, 4, 4]  # padding rows read the scratch table row
    assert buf.limit.tolist() == [6, 9, 9, 9, 1, 1, 1, 1]
    assert buf.tree_mask.tolist() == [0, 1, 3, 5, 0, 0, 0, 0]
    assert buf.tables[0, :2].tolist() == [7, 3] and buf.tables[1, :3].tolist() == [2, 8, 6]
    assert buf.tables[4].tolist() == [50] * 6
    meta = buf.metadata(8)
    assert meta.paged.seq.data_ptr() == buf.seq.data_ptr() and meta.slot_mapping.shape == (8,)
    # a smaller next step overwrites the rows it uses and pads the rest of its bucket again
    buf.fill(step_rows([9], [5], [SeqSlice(5, 1, [7, 3])], BS), 2)
    assert buf.ids[:2].tolist() == [9, 0] and buf.seq[:2].tolist() == [0, 4]


def test_steps_that_do_not_fit_run_eagerly():
    buf = StaticBuffers(
        max_rows=4, max_seqs=2, max_blocks=3, scratch_block=50, block_size=BS, device=torch.device("cpu")
    )
    runner = GraphRunner(model=None, kv=[], buffers=buf, sizes=capture_sizes(4), capture=False)
    assert runner.bucket(_step()) == 4
    too_many_seqs = step_rows([1, 2, 3], [0, 0, 0], [SeqSlice(0, 1, [1])] * 3, BS)
    too_wide = step_rows([1], [20], [SeqSlice(20, 1, [1, 2, 3, 4, 5, 6])], BS)
    too_many_rows = step_rows(list(range(5)), list(range(5)), [SeqSlice(0, 5, [1, 2])], BS)
    assert runner.bucket(too_many_seqs) is None and runner.bucket(too_wide) is None
    assert runner.bucket(too_many_rows) is None


def test_a_replay_returns_the_steps_rows_of_the_buckets_outputs():
    """The forward runs over the whole bucket; callers get the step's own rows (CPU: no capture, same buffers)."""
    seen = []

    def model(ids, positions, kv, meta):
        seen.append((ids.clone(), meta.paged.limit.clone()))
        return ids.float().unsqueeze(1) * 2, [ids.float().unsqueeze(1)]

    buf = StaticBuffers(
        max_rows=8, max_seqs=4, max_blocks=6, scratch_block=50, block_size=BS, device=torch.device("cpu")
    )
    runner = GraphRunner(model, [], buf, capture_sizes(8), capture=False)
    rows = _step()
    hidden, aux, slots = runner.run(rows, runner.bucket(rows))
    assert seen[0][0].tolist() == [11, 12, 13, 14] and runner.replays == 1  # bucket 4: no padding needed
    assert hidden[:, 0].tolist() == [22, 24, 26, 28] and aux[0].shape == (4, 1) and slots.tolist() == rows.slots
    rows3 = step_rows([5, 6, 7], [1, 2, 3], [SeqSlice(1, 3, [9])], BS)
    hidden, _, _ = runner.run(rows3, runner.bucket(rows3))
    assert seen[1][0].tolist() == [5, 6, 7, 0] and seen[1][1].tolist() == [2, 3, 4, 1] and hidden.shape == (3, 1)
