"""The Triton paged-attention kernel (decode, extend, EAGLE tree verify) against the reference attention, on
random paged layouts, ragged lengths, GQA ratios and tree masks, in Triton's interpreter on CPU."""

from __future__ import annotations

import random

import pytest
import torch
import triton  # noqa: F401 - a pinned dependency: its absence is an error here, never a skip

from worker.kernels.triton_attention import paged_rows, triton_attend
from worker.model.attention import attend, build_attention_metadata
from worker.model.seq_slice import SeqSlice, TreeKeys, slots_of

BS = 4


def _tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """A random tree over n nodes (node 0 the root): each row sees its ancestors and itself."""
    parent = [-1] + [rng.randrange(i) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    return mask


def _layout(rng: random.Random, num_blocks: int):
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for kind in ("decode", "decode", "extend", "tree", "prefill", "tree"):
        ctx = rng.randint(0, 40)
        sizes = {"decode": 1, "extend": rng.randint(2, 12), "tree": rng.randint(2, 10), "prefill": rng.randint(17, 30)}
        q = sizes[kind]
        blocks = [free.pop() for _ in range(-(-(ctx + q) // BS))]
        tree = None
        if kind == "tree":
            write = slots_of(blocks, range(ctx, ctx + q), BS)
            tree = TreeKeys(write, write, _tree_mask(q, rng))
        seqs.append(SeqSlice(ctx, q, blocks, tree))
    return seqs


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("seed", [0])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_triton_kernel_matches_reference_attention(heads, kv_heads, seed, device):
    rng, d = random.Random(seed), 16
    torch.manual_seed(seed)
    seqs = _layout(rng, 200)
    slots = 200 * BS
    k_cache, v_cache = torch.randn(slots, kv_heads, d), torch.randn(slots, kv_heads, d)
    n = sum(s.q_len for s in seqs)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    meta = build_attention_metadata(seqs, BS, torch.device("cpu"))
    ref = attend(q, k, v, k_cache, v_cache, meta, d**-0.5)  # writes k, v into the caches too
    dev = torch.device(device)  # cuda: the compiled kernel on the GPU (the device check), cpu: the interpreter
    out = triton_attend(
        q.to(dev), k_cache.to(dev), v_cache.to(dev), paged_rows(seqs, dev), BS, d**-0.5, block_n=8
    ).cpu()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def test_model_with_the_triton_backend_decodes_like_the_reference(tiny_llama):
    """Prefill, decode and EAGLE verify through the kernel (interpreter) give the reference's greedy tokens."""
    from devtools.models import save_random_eagle_head
    from runtime.engine import Engine
    from worker.config import EngineConfig, SpecConfig
    from worker.model.config import load_model_config
    from worker.model.files import resolve_model
    from worker.sampling.params import SamplingParams

    prompts = [[5, 17, 400, 9000, 12, 77, 3], [22, 1534, 7, 900, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11, 11]]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    base = EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=512, disable_radix_cache=True)
    with Engine(base) as eng:
        ref = [r.token_ids for r in eng.generate(prompts, params)]
    head = save_random_eagle_head(tiny_llama.parent / "triton-head", load_model_config(resolve_model(str(tiny_llama))))
    spec = SpecConfig("EAGLE", str(head), num_steps=2, eagle_topk=2, num_draft_tokens=4, cost_table="off")
    with Engine(base.replace(attention_backend="triton", spec=spec)) as eng:  # prefill, draft and verify steps
        assert [r.token_ids for r in eng.generate(prompts, params)] == ref
    # the graph path's static buffers, buckets and padding rows (everything but the capture itself), with EAGLE's
    # verify trees (plain decode rows through them: tests/engine/test_gpu_path.py)
    for s in (spec,):
        with Engine(
            base.replace(attention_backend="triton", debug_graph_buffers_on_cpu=True, cuda_graph_max_rows=8, spec=s)
        ) as eng:
            assert [r.token_ids for r in eng.generate(prompts, params)] == ref
            assert eng.stats.snapshot.graph_replays > 0
