"""The fused CPU kernels (worker/kernels/csrc/cpu_kernels.cpp) against float32 references built from plain torch
ops, and the property speculation relies on: a row's result does not depend on the rows computed with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_choice
from worker.model.layers import RotaryEmbedding, rope_rows

K = cpu_kernels.ops(torch.device("cpu"))
pytestmark = pytest.mark.skipif(K is None, reason="the fused CPU kernels did not build (a warning says why)")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add_match_float32(dtype):
    g = _gen()
    x, delta = torch.randn(5, 576, generator=g).to(dtype), torch.randn(5, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    assert torch.allclose(K.rms_norm(x, w, 1e-5).float(), ref, atol=tol, rtol=tol)
    total, normed = K.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(total, x + delta)  # the residual rounds exactly as torch's add
    assert torch.allclose(normed.float(), F.rms_norm((x + delta).float(), (576,), w.float(), 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_float32(dtype):
    gate_up = (4 * torch.randn(3, 2 * 1536, generator=_gen())).to(dtype)  # gates well into both tails
    gate, up = gate_up.float().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(K.silu_mul(gate_up).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])  # bfloat16 models cache bfloat16
@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary
def test_rope_write_cache_matches_eager_rotary(rot, cache_dtype):
    h, hkv, d, n = 9, 3, 64, 4
    g = _gen()
    qkv = torch.randn(n, (h + 2 * hkv) * d, generator=g).bfloat16()
    q, k, v = (
        qkv[:, : h * d].view(n, h, d),
        qkv[:, h * d : (h + hkv) * d].view(n, hkv, d),
        qkv[:, (h + hkv) * d :].view(n, hkv, d),
    )
    cos, sin = RotaryEmbedding(rot, 1024, 10000.0, {}).table(torch.tensor([0, 7, 300, 1000]), torch.float32)
    k_cache, v_cache = torch.zeros(64, hkv, d, dtype=cache_dtype), torch.zeros(64, hkv, d, dtype=cache_dtype)
    slots = torch.tensor([3, 17, 40, 63])
    q_rot = K.rope_write_cache(q, k, v, cos.view(n, -1), sin.view(n, -1), k_cache, v_cache, slots)
    ref = rope_rows(torch.cat([q, k], dim=1).float(), cos, sin)
    assert torch.allclose(q_rot, ref[:, :h], atol=1e-6)
    # rotated in float32, rounded once on the write
    assert torch.allclose(k_cache[slots].float(), ref[:, h:].to(cache_dtype).float(), atol=1e-6)
    assert torch.equal(v_cache[slots], v.to(cache_dtype))
    untouched = torch.ones(64, dtype=torch.bool).index_fill_(0, slots, False)
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 48])  # the vector paths (AVX-512 or AVX2) and the generic one
def test_attend_rows_matches_softmax_attention_and_is_row_independent(d, cache_dtype):
    h, hkv, slots_total = 9, 3, 512
    g = _gen()
    k_cache = torch.randn(slots_total, hkv, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(slots_total, hkv, d, generator=g).to(cache_dtype)
    q = torch.randn(4, h, d, generator=g)
    # a decode row and three tree rows: shared context, then each row's own ancestors, in scattered slots
    context = list(range(100, 400))
    keys = [context, context + [450], context + [450, 451], context + [450, 452]]
    width = 320
    row_slots = torch.zeros(4, width, dtype=torch.long)
    for r, ks in enumerate(keys):
        row_slots[r, : len(ks)] = torch.tensor(ks)
    counts = torch.tensor([len(ks) for ks in keys])
    scale = d**-0.5
    out = K.attend_rows(q, k_cache, v_cache, row_slots, counts, scale, torch.float32)
    for r, ks in enumerate(keys):  # the reference reads the same cached values, in float32
        kk = k_cache[ks].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        vv = v_cache[ks].float().repeat_interleave(h // hkv, dim=1)
        probs = (torch.einsum("hd,lhd->hl", q[r], kk) * scale).softmax(-1)
        assert torch.allclose(out[r], torch.einsum("hl,lhd->hd", probs, vv), atol=1e-5)
        alone = K.attend_rows(
            q[r : r + 1].contiguous(), k_cache, v_cache, row_slots[r : r + 1], counts[r : r + 1], scale, torch.float32
        )
        assert torch.equal(alone[0], out[r])  # bits independent of the rows beside it


@pytest.mark.parametrize("d", [64, 128, 48])
def test_a_chunks_rows_over_one_shared_list_get_the_bits_each_row_gets_alone(d):
    """A prefill chunk passes one key list for all its rows (row r reads its first counts[r] slots): every row gets
    the bits of the same position decoded alone, so a prompt's numbers do not depend on how it was chunked or how
    much of it the prefix cache held."""
    h, hkv = 6, 2
    g = _gen(1)
    k_cache = torch.randn(256, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(256, hkv, d, generator=g).bfloat16()
    keys = torch.randperm(256, generator=g)[:90]  # a sequence's slots, in position order, scattered over blocks
    q = torch.randn(40, h, d, generator=g)
    counts = torch.arange(51, 91)  # the chunk's rows are positions 50..89 after 50 cached tokens
    chunk = K.attend_rows(q, k_cache, v_cache, keys.view(1, -1), counts, d**-0.5, torch.bfloat16)
    for r in (0, 17, 39):
        alone = K.attend_rows(
            q[r : r + 1].contiguous(),
            k_cache,
            v_cache,
            keys[: counts[r]].view(1, -1),
            counts[r : r + 1],
            d**-0.5,
            torch.bfloat16,
        )
        assert torch.equal(chunk[r], alone[0])
    with pytest.raises(RuntimeError, match="1..width keys"):
        K.attend_rows(q, k_cache, v_cache, keys[:60].view(1, -1), counts, d**-0.5, torch.bfloat16)


def test_attend_rows_refuses_bad_slots():
    k_cache = torch.zeros(16, 1, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        K.attend_rows(
            torch.zeros(1, 1, 64), k_cache, k_cache, torch.tensor([[0, 99]]), torch.tensor([2]), 1.0, torch.float32
        )


def test_bfloat16_models_cache_bfloat16_where_the_fused_kernels_attend():
    from worker.runner import kv_cache_dtype

    cpu = torch.device("cpu")
    assert kv_cache_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert kv_cache_dtype(torch.float32, cpu) == torch.float32  # the float32 reference stays exact
    assert kv_cache_dtype(torch.float32, cpu, quantized=True) == torch.bfloat16  # int8act's served numerics
    assert kv_cache_dtype(torch.bfloat16, cpu, "triton") == torch.float32  # the interpreter's path is unchanged


@pytest.mark.parametrize("rows", [1, 4])
def test_decoder_layer_kernel_gives_the_python_layers_bits(smol_dir, rows, monkeypatch):
    """cpu_kernels.decoder_layer runs a whole quantized layer in one call, and decoder_stack every layer in one call:
    the hidden states, EAGLE-3's features and the KV they write must be exactly those of the layer's ops called one by
    one from Python."""
    import worker.model.causal_lm as model
    from worker.config import EngineConfig
    from worker.dist import TPGroup
    from worker.model.files import resolve_model
    from worker.model.seq_slice import SeqSlice
    from worker.runner import ModelRunner

    if cpu_choice.active().name == "portable":
        pytest.skip("needs AVX2 or AVX512-BF16: the one-call layer runs on qlinear, and no variant runs on this CPU")
    runner = ModelRunner(
        EngineConfig(dtype="bfloat16", max_total_tokens=1024),
        resolve_model(str(smol_dir)),
        TPGroup(0, 1, torch.device("cpu")),
    )
    runner.model.aux_layers = {2, 15, 27}
    ctx, table = 40, list(range(8))
    stack = model.fused_stack
    with torch.inference_mode():
        runner.run_model(list(range(100, 100 + ctx)), list(range(ctx)), [SeqSlice(0, ctx, table)])
        assert model.fused_weights(runner.model.layers[0], K, torch.bfloat16) is not None
        before = [(k.clone(), v.clone()) for k, v in runner.kv]
        out = {}
        calls = []
        monkeypatch.setattr(K, "decoder_stack", lambda *a, f=K.decoder_stack: calls.append(1) or f(*a), raising=False)
        for way in ("stack", "layer by layer", "unfused"):
            model.FUSED_LAYERS = way != "unfused"
            monkeypatch.setattr(model, "fused_stack", stack if way == "stack" else lambda *a: None)
            try:
                for (k, v), (k0, v0) in zip(runner.kv, before):
                    k.copy_(k0)
                    v.copy_(v0)
                hidden, aux, _ = runner.run_model(
                    [7 + r for r in range(rows)], list(range(ctx, ctx + rows)), [SeqSlice(ctx, rows, table)]
                )
                out[way] = (hidden, aux, [(k.clone(), v.clone()) for k, v in runner.kv])
            finally:
                model.FUSED_LAYERS = True
    assert len(calls) == 1  # the stack ran once, as one call
    for way in ("stack", "layer by layer"):
        hidden, aux, kv = out[way]
        assert torch.equal(hidden, out["unfused"][0])
        assert len(aux) == 3 and all(torch.equal(a, b) for a, b in zip(aux, out["unfused"][1]))
        assert all(torch.equal(a, b) for pa, pb in zip(kv, out["unfused"][2]) for a, b in zip(pa, pb))
