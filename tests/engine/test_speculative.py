"""EAGLE speculative decoding: lossless greedy, rank-0-authoritative decisions under rank noise, head formats."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from devtools.models import save_copy_eagle_head, save_random_eagle_head
from runtime.engine import Engine, EngineDeadError
from speculative.defaults import DEFAULT_HEAD
from speculative.heads import read_draft
from speculative.tree import VerifyTree
from speculative.verify import verify_sampling
from worker.config import EngineConfig, SpecConfig
from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_choice
from worker.model.config import load_model_config
from worker.model.files import ModelLoadError, resolve_model
from worker.sampling.params import SamplingParams

# repetitive prompts make the copy head's drafts accepted (multi-token commits), the others mostly rejected
PROMPTS = [
    "A A A A A A A A A A A A",
    "1 1 1 1 1 1 1 1 1 1 1 1 1",
    "The capital of France is",
    "ha ha ha ha ha ha",
    "Write a list of colors: red, green,",
    "x x x x x x x x",
]
LENGTHS = [40, 33, 20, 17, 25, 9]  # finishes land inside accepted runs too


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _spec(head, topk: int, algo: str = "EAGLE", steps: int = 4) -> SpecConfig:
    """The full tree on every step (no cost-aware budget, tested in test_spec_budget.py), so each step drafts."""
    return SpecConfig(
        algo,
        str(head),
        num_steps=steps,
        eagle_topk=topk,
        num_draft_tokens=steps + 1 if topk == 1 else 8,
        cost_table="off",
    )


@pytest.fixture(scope="module")
def smol_cfg(smol_dir):
    return load_model_config(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def copy_head(tmp_path_factory, smol_cfg):
    return save_copy_eagle_head(tmp_path_factory.mktemp("copy-head"), smol_cfg)


@pytest.fixture(scope="module")
def reference(served_engine):
    """Plain greedy output on the served numerics, which speculation must reproduce exactly."""
    prompts = [served_engine.encode(p) for p in PROMPTS]
    return prompts, [r.token_ids for r in served_engine.generate(prompts, [_greedy(n) for n in LENGTHS])]


@pytest.mark.parametrize("topk", [1, 3])
def test_speculative_greedy_is_lossless_in_a_mixed_batch(copy_head, reference, topk):
    prompts, ref = reference
    cfg = EngineConfig(max_total_tokens=4096, spec=_spec(copy_head, topk))
    with Engine(cfg) as eng:
        out = eng.generate(prompts, [_greedy(n) for n in LENGTHS])
        # plain requests (no speculation needed) interleave with speculative ones in the same engine
        more = eng.generate(prompts[:2], [_greedy(5), SamplingParams(max_new_tokens=8, temperature=0)])
        stats = eng.stats.values
    assert [r.token_ids for r in out] == ref
    assert [r.token_ids for r in more] == [ref[0][:5], ref[1][: len(more[1].token_ids)]]
    assert stats["spec_accepted_tokens"] > 10  # multi-token commits really happened
    assert stats["spec_accept_length_mean"] > 1.0
    assert stats["kv_used_tokens"] == 0 and stats["running"] == 0


def test_random_eagle3_head_is_lossless(tmp_path, smol_cfg, reference):
    prompts, ref = reference
    head = save_random_eagle_head(tmp_path / "e3", smol_cfg, "eagle3")
    with Engine(EngineConfig(max_total_tokens=4096, spec=_spec(head, 2, "EAGLE3", 3))) as eng:
        out = eng.generate(prompts[2:4], [_greedy(n) for n in LENGTHS[2:4]])
    assert [r.token_ids for r in out] == ref[2:4]


def test_tiny_llama_tp2_speculative_matches_tp1_plain(tiny_llama, tmp_path):
    cfg_t = load_model_config(resolve_model(str(tiny_llama)))
    head = save_copy_eagle_head(tmp_path / "h", cfg_t)
    prompts = [[5, 6, 7, 8] * 3, [100, 200, 300], [9] * 10]
    params = [_greedy(n) for n in (30, 21, 14)]
    with Engine(EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=2048)) as eng:
        ref = [r.token_ids for r in eng.generate(prompts, params)]
    for topk in (1, 2):
        cfg = EngineConfig(
            model_path=str(tiny_llama),
            dtype="float32",
            max_total_tokens=2048,
            tp_size=2,
            spec=_spec(head, topk, steps=3),
        )
        with Engine(cfg) as eng:
            assert [r.token_ids for r in eng.generate(prompts, params)] == ref
            assert eng.stats.values["kv_used_tokens"] == 0


def test_smollm2_tp3_speculative_under_rank_noise_matches_tp1_plain(copy_head, smol_engine):
    """Every rank but 0 adds noise to its logits (all-reduce results that differ by rank, the founding bug's
    trigger): with every decision broadcast from rank 0, tp=3 output is still tp=1's plain output and the guard sees
    no divergence. The batch of three decodes plainly (the batch limit is 3) until its shortest request ends, then
    the other two speculate: plain and speculative tp=3 steps in one engine."""
    prompts = [smol_engine.encode(p) for p in PROMPTS[:3]]
    ref = [r.token_ids for r in smol_engine.generate(prompts, [_greedy(n) for n in (16, 14, 6)])]  # float32, tp=1
    cfg = EngineConfig(
        dtype="float32",
        max_total_tokens=2048,
        tp_size=3,
        debug_rank_logit_noise=NOISE,
        spec=dataclasses.replace(_spec(copy_head, 2, steps=3), disable_batch_size=3),
        dist_timeout=60,
    )
    with Engine(cfg) as eng:
        out = eng.generate(prompts[:3], [_greedy(n) for n in (16, 14, 6)])
        assert eng.stats.values["spec_verify_steps"] > 0 and eng.stats.values["rank_divergences"] == 0
    assert [r.token_ids for r in out] == ref


def test_quantized_speculation_is_identical(copy_head, smol_dir):
    """The served numerics (the file's 4-bit weights on this CPU's auto kernel, its auto dtype): the quantized linears
    and row-wise attention compute each row on its own, so verifying a token inside a tree gives the bits decoding
    it alone gives, and speculative greedy output equals plain greedy output exactly.
    The speculative engine also serves from its prefix cache: each prompt again behind a shared preamble, then each
    prompt with the start of its answer appended, so hits of many lengths split the prompts into cached blocks, a
    chunk of a few rows and chunks of many. A position's attention reads the same keys in the same order however it
    is split, so the answers equal the plain engine's, which caches nothing and prefills every prompt whole."""
    prompts = PROMPTS + ["Tell me about the moon.", "Why is the sky blue?", "Name a famous painter."]
    preamble = "You are a patient teacher. Answer plainly, in a few sentences, for a curious reader. " * 3
    cfg = EngineConfig(dtype="auto", quantization="auto", max_total_tokens=4096)
    runs = {}
    for name, spec, cold in (("plain", SpecConfig(), True), ("spec", _spec(copy_head, 2), False)):
        with Engine(cfg.replace(spec=spec, disable_radix_cache=cold)) as eng:
            ids = [eng.encode(p) for p in prompts]
            out = [r.token_ids for r in eng.generate(ids, [_greedy(24)] * len(ids))]
            out += [eng.generate([eng.encode(preamble + p)], _greedy(24))[0].token_ids for p in prompts]
            out += [eng.generate([i + o[:k]], _greedy(8))[0].token_ids for i, o, k in zip(ids, out, range(3, 30, 3))]
            runs[name] = (out, dict(eng.stats.values))
    (plain, plain_stats), (spec, spec_stats) = runs["plain"], runs["spec"]
    assert spec_stats["spec_verify_steps"] > 0 and spec_stats["prefix_cache_hit_tokens"] > 0
    assert "prefix_cache_hit_tokens" not in plain_stats
    assert spec == plain


# --- rank noise: rank 0 decides, so noise cannot split the ranks -------------------------------------------
NOISE = 3.0


def _noisy(tiny_llama, head, **kw) -> EngineConfig:
    return EngineConfig(
        model_path=str(tiny_llama),
        dtype="float32",
        max_total_tokens=4096,
        tp_size=kw.pop("tp", 2),
        debug_rank_logit_noise=NOISE,
        dist_timeout=30,
        **kw,
    )


def test_rank_noise_with_broadcast_stays_consistent(tiny_llama, tmp_path):
    head = save_random_eagle_head(tmp_path / "h", load_model_config(resolve_model(str(tiny_llama))), "eagle")
    prompts = [[i + 3, 2 * i + 5, 7, 11] for i in range(12)]
    params = [
        SamplingParams(max_new_tokens=20, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(12)
    ]
    for spec in (_spec(head, 2, steps=3), SpecConfig()):
        with Engine(_noisy(tiny_llama, head, spec=spec)) as eng:
            out = eng.generate(prompts, params)
            assert all(len(r.token_ids) == 20 for r in out)
            assert eng.is_alive and eng.stats.values["rank_divergences"] == 0
            assert eng.stats.values["kv_used_tokens"] == 0


def test_skipping_the_decision_broadcast_is_caught_not_hung(tiny_llama, tmp_path):
    """Without the broadcast each rank accepts by its own noisy logits (the upstream bug): the guard must
    report the divergence and fail the requests within seconds; nothing may hang."""
    head = save_random_eagle_head(tmp_path / "h", load_model_config(resolve_model(str(tiny_llama))), "eagle")
    eng = Engine(_noisy(tiny_llama, head, spec=_spec(head, 2, steps=3), debug_skip_decision_broadcast=True))
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"RankDivergenceError: TP ranks diverged at step \d+"):
            eng.generate([[3, 4, 5]] * 4, _greedy(200), timeout=60)
        assert time.monotonic() - t0 < 60
        assert eng.stats.values["rank_divergences"] == 1
        assert not eng.is_alive
    finally:
        eng.shutdown()


def test_skip_broadcast_is_refused_without_noise(tiny_llama):
    with pytest.raises(ValueError, match="refused without --debug-rank-logit-noise"):
        Engine(EngineConfig(model_path=str(tiny_llama), debug_skip_decision_broadcast=True))


# --- lossless rejection sampling -------------------------------------------------------------------------
def test_rejection_sampling_keeps_the_target_distribution():
    """Toy tree: root with children tokens 2 and 0, token 2 with child 1. Over many draws the emitted first and
    second tokens must follow the target's distribution (total-variation bound)."""
    tree = VerifyTree(tokens=[9, 2, 0, 1], parents=[-1, 0, 0, 1], depths=[0, 1, 1, 2])
    p_root = torch.tensor([0.1, 0.25, 0.4, 0.05, 0.2])
    p_after = {2: torch.tensor([0.3, 0.3, 0.1, 0.2, 0.1]), 0: torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2])}

    def node_probs(node, path_tokens):
        if node == 0:
            return p_root
        return p_after[tree.tokens[node]] if tree.tokens[node] in p_after else torch.full((5,), 0.2)

    gen = torch.Generator().manual_seed(0)
    n = 20000
    first = torch.zeros(5)
    second_after_2 = torch.zeros(5)
    for _ in range(n):
        path, bonus = verify_sampling(tree, node_probs, gen)
        emitted = [tree.tokens[x] for x in path] + [bonus]
        first[emitted[0]] += 1
        if emitted[0] == 2 and len(emitted) > 1:
            second_after_2[emitted[1]] += 1
    tv_first = 0.5 * (first / n - p_root).abs().sum().item()
    tv_second = 0.5 * (second_after_2 / second_after_2.sum() - p_after[2]).abs().sum().item()
    assert tv_first < 0.015, tv_first
    assert tv_second < 0.025, tv_second


# --- checkpoint formats ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,fmt", [("eagle", "bin"), ("eagle", "safetensors"), ("eagle3", "safetensors")])
def test_published_head_layouts_load(tmp_path, smol_cfg, kind, fmt):
    head = save_random_eagle_head(tmp_path / kind, smol_cfg, kind, fmt=fmt)
    dcfg, state = read_draft(head, smol_cfg)
    assert dcfg.kind == kind
    if kind == "eagle3":
        assert dcfg.draft_vocab_size == 1024 and dcfg.aux_layers == (2, 15, 27)
    from speculative.heads import load_draft_head
    from worker.dist import single_rank_group
    from worker.model.loader import load_target

    target, _ = load_target(
        EngineConfig(), resolve_model("smollm2-135m-instruct"), single_rank_group(torch.device("cpu")), torch.float32
    )
    loaded = load_draft_head(head, target, single_rank_group(torch.device("cpu")), torch.float32, 512)
    assert torch.equal(loaded.fc.weight, state["fc.weight"])


def test_wrong_head_gives_clear_errors(tmp_path, smol_cfg, tiny_llama):
    import json

    from safetensors.torch import load_file, save_file

    head = save_random_eagle_head(tmp_path / "bad", smol_cfg, "eagle")
    state = load_file(str(head / "model.safetensors"))
    state["fc.weight"] = torch.zeros(576, 100)
    save_file(state, str(head / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fc.weight takes 100 inputs"):
        read_draft(head, smol_cfg)
    cfg = json.loads((head / "config.json").read_text())
    cfg["hidden_size"] = 1024
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="hidden size 1024 does not match"):
        read_draft(head, smol_cfg)
    (head / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor pytorch_model.bin"):
        read_draft(head, smol_cfg)
    # the engine refuses at start-up (on the small target: the refusal does not depend on the target's size)
    tiny = EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=512)
    with pytest.raises(EngineDeadError, match="draft head path"):
        Engine(tiny.replace(spec=SpecConfig("EAGLE", str(tmp_path / "missing"))))
    eagle12 = save_random_eagle_head(tmp_path / "e12", load_model_config(resolve_model(str(tiny_llama))), "eagle")
    with pytest.raises(EngineDeadError, match="EAGLE3 needs an EAGLE-3 head"):
        Engine(tiny.replace(spec=SpecConfig("EAGLE3", str(eagle12))))


def test_draft_head_runs_int8_beside_a_quantized_target():
    """A quantized target on CPU gets an int8 draft head (half the bytes a draft forward streams); its draft logits
    keep the dense head's choice. Output stays the target's whatever the draft proposes (the identity tests above)."""
    from speculative.heads import load_draft_head
    from speculative.worker import draft_bits
    from worker.dist import single_rank_group
    from worker.kernels.quant import QBlocks
    from worker.model.layers import quantize_linears
    from worker.model.loader import load_target

    ops = cpu_kernels.ops(torch.device("cpu"))
    if cpu_choice.active().name == "portable":
        pytest.skip("needs AVX2 or AVX512-BF16: no qlinear variant runs on this CPU")
    group = single_rank_group(torch.device("cpu"))
    model = resolve_model("smollm2-135m-instruct")
    dense_target, _ = load_target(EngineConfig(dtype="float32"), model, group, torch.float32)
    assert draft_bits("auto", dense_target) is None and draft_bits("int4", dense_target) == 4
    target, _ = load_target(EngineConfig(dtype="bfloat16", quantization="auto"), model, group, torch.bfloat16)
    assert draft_bits("auto", target) == 8 and draft_bits("none", target) is None
    dense = load_draft_head(DEFAULT_HEAD, target, group, torch.bfloat16, 512)
    head = load_draft_head(DEFAULT_HEAD, target, group, torch.bfloat16, 512)
    assert quantize_linears(head, 8, torch.bfloat16) == 6  # fc, qkv, o, gate_up, down, lm_head
    assert all(m.qweight.bits == 8 for m in head.modules() if isinstance(getattr(m, "qweight", None), QBlocks))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 576, generator=g).bfloat16()
    with torch.inference_mode():
        a, b = dense.logits(x), head.logits(x)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert ((a - b).abs().max() / a.abs().max()) < 0.05
    # the quantized draft layer runs as one kernel call (worker/model/causal_lm.py) with the bits of its ops called
    # one by one
    import worker.model.causal_lm as model_mod
    from worker.model.attention import build_attention_metadata
    from worker.model.seq_slice import SeqSlice

    meta = build_attention_metadata([SeqSlice(10, 3, list(range(16)))], 16, torch.device("cpu"), "torch")
    ids, pos, feats = torch.tensor([5, 6, 7]), torch.tensor([10, 11, 12]), torch.randn(3, 576, generator=g).bfloat16()
    fresh = [torch.randn(256, *widths, generator=g).bfloat16() for widths in head.attention.cache_widths]
    runs = {}
    with torch.inference_mode():
        assert model_mod.fused_weights(head.midlayer, ops, torch.bfloat16) is not None
        for fused in (True, False):
            model_mod.FUSED_LAYERS = fused
            try:
                kv = tuple(t.clone() for t in fresh)
                runs[fused] = (head(ids, feats, pos, kv, meta), kv)
            finally:
                model_mod.FUSED_LAYERS = True
    assert torch.equal(runs[True][0], runs[False][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
