"""The founding scenario's models: multi-head latent attention with grouped MoE and the checkpoint's own MTP layer
(GLM-4.7-Flash, DeepSeek-V3), built small with transformers' own classes. Logits and greedy output against
transformers, the latent cache and its absorbed decode, tp=2 and tp=4 against tp=1, the MTP draft against a
reference assembled from transformers' decoder layer, and the founding bug reproduced on this architecture."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from devtools.models import save_tiny_model
from runtime.engine import Engine, EngineDeadError
from worker.config import EngineConfig, SpecConfig
from worker.dist import single_rank_group
from worker.model.files import resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner, kv_bytes_per_token
from worker.sampling.params import SamplingParams

PROMPTS = [[5, 17, 400, 9000, 12, 77, 3], [22, 1534, 7, 900] * 5, [9, 9, 9, 100, 200, 300, 400, 500, 600]]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
LAYERS = {"glm4_moe_lite": 3, "deepseek_v3": 4}
_MODELS: dict[str, tuple[Path, list[list[int]]]] = {}


def _mtp(steps: int = 3, topk: int = 1, algo: str = "EAGLE") -> SpecConfig:
    """The checkpoint's MTP layer as the draft (no draft path), the full tree on every step."""
    draft = steps + 1 if topk == 1 else 6
    return SpecConfig(algo, None, num_steps=steps, eagle_topk=topk, num_draft_tokens=draft, cost_table="off")


def _engine_config(folder: Path, tp: int = 1, **kw) -> EngineConfig:
    trace = kw.pop("trace", None)
    return EngineConfig(
        model_path=str(folder),
        dtype=kw.pop("dtype", "float32"),
        tp_size=tp,
        max_total_tokens=1024,
        dist_timeout=30,
        debug_collective_trace=str(trace) if trace else None,
        **kw,
    )


def _greedy(folder: Path, tp: int = 1, **kw) -> list[list[int]]:
    with Engine(_engine_config(folder, tp, **kw)) as eng:
        out = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
        assert eng.stats.values["kv_used_tokens"] == 0
        return out


def _model(arch: str, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """One tiny model per architecture (its MTP layer included) and its tp=1 plain greedy output."""
    if arch not in _MODELS:
        folder = save_tiny_model(tmp_path_factory.mktemp(arch), arch, heads=8, kv_heads=8, layers=LAYERS[arch], seed=5)
        _MODELS[arch] = (folder, _greedy(folder))
    return _MODELS[arch]


@pytest.fixture(scope="module", params=list(LAYERS))
def mla_model(request, tmp_path_factory, smol_dir) -> tuple[Path, list[list[int]]]:
    return _model(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def glm_lite(tmp_path_factory, smol_dir) -> tuple[Path, list[list[int]]]:
    return _model("glm4_moe_lite", tmp_path_factory)


def _runner(folder: Path, **kw) -> ModelRunner:
    cfg = EngineConfig(model_path=str(folder), dtype="float32", max_total_tokens=256, **kw)
    return ModelRunner(cfg, resolve_model(str(folder)), single_rank_group(torch.device("cpu")))


def _prefill(runner: ModelRunner, ids: list[int], start: int = 0) -> torch.Tensor:
    blocks = list(range(runner.num_blocks))
    return runner.forward(ForwardPlan(1, ids, [(start, len(ids), blocks)], list(range(len(ids)))))[0]


def test_logits_and_greedy_match_transformers(mla_model):
    from transformers import AutoModelForCausalLM

    folder, reference = mla_model
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    runner = _runner(folder)
    cfg = runner.model_cfg
    assert cfg.mla and cfg.moe_layers and 0 not in cfg.moe_layers and cfg.mtp_layers == 1
    assert cfg.rope_interleave and (cfg.q_lora_rank > 0) == (cfg.architecture == "glm4_moe_lite")
    for ids in PROMPTS[:2]:  # 7 rows attend row-wise (absorbed), 20 rows as a chunk (expanded)
        logits = _prefill(runner, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    for ids, out in zip(PROMPTS, reference):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert out == ref[0, len(ids) :].tolist()


def test_the_pool_caches_one_latent_per_token_and_latent_decode_equals_expanded(mla_model):
    folder, _ = mla_model
    runner = _runner(folder)
    cfg = runner.model_cfg
    latent = cfg.kv_lora_rank + cfg.head_dim  # 32 + 8 here; 512 + 64 = 576 for GLM-4.7-Flash and DeepSeek-V3
    assert len(runner.kv) == cfg.num_layers
    for k, v in runner.kv:
        assert k.shape == (runner.num_blocks * runner.block_size, 1, latent) and v.numel() == 0
    assert kv_bytes_per_token(runner.model, runner.kv_dtype) == cfg.num_layers * latent * 4
    ids = PROMPTS[1]  # 20 tokens: one chunk runs the expanded path
    expanded = _prefill(runner, ids)[-1]
    _prefill(runner, ids[:17])
    rows = [_prefill(runner, [t], start=17 + i)[0] for i, t in enumerate(ids[17:])]  # one row at a time: absorbed
    assert ((rows[-1] - expanded).abs().max() / expanded.abs().max()).item() <= 1e-5


def test_tp_matches_tp1_and_routing_agrees_under_router_noise(mla_model, tmp_path):
    folder, reference = mla_model
    tp = 2 if "deepseek" in folder.name else 4
    assert _greedy(folder, tp, debug_rank_router_noise=5.0, trace=tmp_path) == reference
    traces = [json.loads(t.read_text()) for t in sorted(tmp_path.glob("rank*.json"))]
    routing = [[e for e in t if e[0] == "moe_routing"] for t in traces]
    assert len(traces) == tp and routing[0] and all(r == routing[0] for r in routing)


def _mtp_reference(folder: Path, ids: list[int]) -> torch.Tensor:
    """The MTP layer's logits at every position of `ids`, assembled from transformers' own decoder-layer class with
    the published wiring: eh_proj([enorm(embed(next token)) ; hnorm(hidden)]) -> layer -> shared_head.norm -> head."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(str(folder))
    n = config.num_hidden_layers
    if getattr(config, "mlp_layer_types", None):
        config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"]
    module = sys.modules[type(hf).__module__]
    layer = getattr(module, type(hf).__name__.replace("ForCausalLM", "DecoderLayer"))(config, n).eval()
    prefix = f"model.layers.{n}."
    state = {k[len(prefix) :]: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix)}
    experts = layer.mlp.experts
    for e in range(experts.num_experts):  # the published per-expert tensors into transformers' fused layout
        g, u, d = (state.pop(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
        experts.gate_up_proj.data[e] = torch.cat([g, u])
        experts.down_proj.data[e] = d
    layer.load_state_dict({k: v for k, v in state.items() if k in layer.state_dict()}, strict=False)
    norm = type(hf.model.norm)
    enorm, hnorm, head_norm = (norm(config.hidden_size, config.rms_norm_eps) for _ in range(3))
    enorm.weight.data, hnorm.weight.data = state["enorm.weight"], state["hnorm.weight"]
    head_norm.weight.data = state["shared_head.norm.weight"]
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0, :-1]  # the target's final hidden at p
        embeds = hf.model.embed_tokens(torch.tensor(ids[1:]))  # the token at p + 1
        x = torch.cat([enorm(embeds), hnorm(hidden)], dim=-1) @ state["eh_proj.weight"].T
        positions = torch.arange(len(ids) - 1).unsqueeze(0)
        rope = hf.model.rotary_emb(x.unsqueeze(0), positions)
        mask = torch.full((len(ids) - 1,) * 2, float("-inf")).triu(1)[None, None]
        out = layer(x.unsqueeze(0), attention_mask=mask, position_ids=positions, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(head_norm(out[0]))


def test_the_mtp_draft_matches_a_transformers_assembled_reference(mla_model):
    from speculative.mtp import load_mtp_draft
    from worker.model.attention import build_attention_metadata
    from worker.model.seq_slice import SeqSlice
    from worker.runner import kv_caches

    folder, _ = mla_model
    runner = _runner(folder)
    draft = load_mtp_draft(runner.config, runner.source, runner.model, runner.tp, runner.dtype)
    ids = PROMPTS[1]
    hidden: list[torch.Tensor] = []
    runner.on_hidden = lambda h, aux, slots: hidden.append(h)
    _prefill(runner, ids)
    n = len(ids) - 1
    kv = kv_caches([draft.attention], 256, runner.kv_dtype, torch.device("cpu"))[0]
    meta = build_attention_metadata([SeqSlice(0, n, list(range(16)))], runner.block_size, torch.device("cpu"))
    with torch.no_grad():
        out = draft(torch.tensor(ids[1:]), hidden[0][:n], torch.arange(n), kv, meta)
        logits = draft.logits(out)
    ref = _mtp_reference(folder, ids)
    assert ((logits - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_mtp_speculation_is_lossless(mla_model):
    folder, reference = mla_model
    for spec in (_mtp(), _mtp(steps=2, topk=2, algo="NEXTN")):
        with Engine(_engine_config(folder, spec=spec)) as eng:
            assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == reference
            stats = eng.stats.values
            assert stats["spec_verify_steps"] > 0 and stats["kv_used_tokens"] == 0
            accepted = stats["spec_eagle_accepted_tokens"] + stats["spec_context_accepted_tokens"]
            assert stats["spec_accepted_tokens"] == accepted  # what /engine/stats and the metrics report
            assert stats["spec_accept_length_mean"] == pytest.approx(1 + accepted / stats["spec_verify_steps"])


def test_mtp_speculation_in_bfloat16_equals_plain_bfloat16(glm_lite):
    folder, _ = glm_lite
    plain = _greedy(folder, dtype="bfloat16")
    assert _greedy(folder, dtype="bfloat16", spec=_mtp(topk=2)) == plain


# the founding scenario: tp=4, the MTP layer drafting trees, ranks 1-3 with noisy router and verify logits
FOUNDING = {"tp": 4, "spec": _mtp(steps=2, topk=2), "debug_rank_router_noise": 5.0, "debug_rank_logit_noise": 3.0}


def test_founding_scenario_tp4_mtp_under_rank_noise_equals_tp1_plain(glm_lite, tmp_path):
    """GLM-4.7-Flash's architecture at tp=4 with its MTP layer drafting, ranks 1-3 seeing noisy router and verify
    logits: rank 0's routing and accept decisions reach every rank, so the output is tp=1's plain greedy output and
    every rank made the same collectives with the same routing."""
    folder, reference = glm_lite
    assert _greedy(folder, **FOUNDING, trace=tmp_path) == reference
    traces = [json.loads(t.read_text()) for t in sorted(tmp_path.glob("rank*.json"))]
    assert len(traces) == 4 and len(traces[0]) > 100 and all(t == traces[0] for t in traces)


def test_founding_bug_without_the_broadcast_is_caught_within_a_step(glm_lite):
    """The upstream bug on its own architecture: each rank routes and accepts by its own noisy logits. The guard
    (rank_consistency_check_interval 1) reports the divergence at the step it happens and nothing hangs."""
    folder, _ = glm_lite
    eng = Engine(_engine_config(folder, **FOUNDING, debug_skip_decision_broadcast=True))
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"RankDivergenceError: TP ranks diverged at step \d+"):
            eng.generate(PROMPTS, GREEDY, timeout=60)
        assert time.monotonic() - t0 < 60 and eng.stats.values["rank_divergences"] == 1
    finally:
        eng.shutdown()


def test_a_checkpoint_without_an_mtp_layer_names_both_options(tmp_path, smol_dir):
    from safetensors.torch import load_file, save_file

    folder = save_tiny_model(tmp_path, "glm4_moe_lite", heads=8, kv_heads=8, layers=2, seed=1)
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("model.layers.2.")}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    with pytest.raises(EngineDeadError, match="no multi-token-prediction layer.*--speculative-draft-model-path.*NONE"):
        Engine(_engine_config(folder, spec=_mtp()))


def test_prefix_cache_chunked_prefill_and_preemption_keep_the_output(glm_lite):
    """Four prompts behind one shared preamble, prefilled in chunks of 24 (row-wise and expanded rows mixed), through
    a pool that holds about two of them, with the MTP layer drafting trees: tp=1 plain greedy output, unchanged."""
    folder, _ = glm_lite
    preamble = [31, 41, 59, 26, 53, 58, 97, 93, 23, 84] * 4
    prompts = [preamble + [100 + i, 7 * i + 3, 900 + i] for i in range(4)]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    with Engine(_engine_config(folder, disable_radix_cache=True)) as eng:
        reference = [r.token_ids for r in eng.generate(prompts, params)]
    cfg = _engine_config(folder, spec=_mtp(steps=2, topk=2)).replace(max_total_tokens=144, chunked_prefill_size=24)
    with Engine(cfg) as eng:
        first = eng.generate(prompts[:1], params)  # its blocks stay in the prefix cache for the others
        out = first + eng.generate(prompts[1:], params)
        stats = eng.stats.values
    assert [r.token_ids for r in out] == reference
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_preemptions"] > 0 and stats["kv_used_tokens"] == 0
