"""Block-FP8 checkpoints (DeepSeek-V3 / GLM FP8 releases), made here by quantizing a small float model: they load
dequantized exactly as stored, match the float model within FP8's tolerance, and bad scales are clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from devtools.models import save_tiny_model
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.model.files import ModelLoadError, resolve_model
from worker.model.fp8 import quantize
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner

BLOCK = (16, 16)  # the published checkpoints use 128 x 128; 16 gives these small weights several, ragged blocks
IDS = [5, 17, 400, 9000, 12, 77, 3, 22, 1534, 7, 900, 31, 8, 64, 1000, 2, 44, 45]


def _blockwise(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]


def _is_quantized(name: str, t: torch.Tensor) -> bool:
    """As the published FP8 releases: every linear, not the embeddings, norms, routers or LM head."""
    return t.dim() == 2 and name.endswith("proj.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smol_dir) -> dict[str, Path]:
    """The float model, its block-FP8 copy, and the float model holding the FP8 copy's values (the reference)."""
    root = tmp_path_factory.mktemp("fp8")
    float_dir = save_tiny_model(root / "float", "glm4_moe_lite", heads=8, kv_heads=8, layers=2, seed=3)
    state = load_file(float_dir / "model.safetensors")
    fp8_state, exact_state = {}, {}
    for name, t in state.items():
        if _is_quantized(name, t):
            q, scale = quantize(t, BLOCK)
            fp8_state[name], fp8_state[name + "_scale_inv"] = q, scale
            exact_state[name] = q.float() * _blockwise(scale, *t.shape)
        else:
            fp8_state[name] = exact_state[name] = t
    folders = {"float": float_dir}
    for kind, st in (("fp8", fp8_state), ("exact", exact_state)):
        folder = root / kind
        folder.mkdir()
        for f in float_dir.iterdir():
            if f.name != "model.safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        save_file(st, folder / "model.safetensors", metadata={"format": "pt"})
        folders[kind] = folder
    raw = json.loads((float_dir / "config.json").read_text())
    q = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic", "fmt": "e4m3"}
    (folders["fp8"] / "config.json").write_text(json.dumps(raw | {"quantization_config": q}))
    return folders


def _runner(folder: Path, **kw) -> ModelRunner:
    cfg = EngineConfig(model_path=str(folder), max_total_tokens=256, **({"dtype": "float32"} | kw))
    return ModelRunner(cfg, resolve_model(str(folder)), single_rank_group(torch.device("cpu")))


def _logits(folder: Path, **kw) -> torch.Tensor:
    runner = _runner(folder, **kw)
    plan = ForwardPlan(1, IDS, [(0, len(IDS), list(range(runner.num_blocks)))], list(range(len(IDS))))
    return runner.forward(plan)[0]


def test_block_fp8_loads_as_stored_and_within_fp8_tolerance_of_the_float_model(models):
    fp8, exact = _logits(models["fp8"]), _logits(models["exact"])
    assert ((fp8 - exact).abs().max() / exact.abs().max()).item() <= 1e-5
    # each loaded weight is the float weight rounded to e4m3 within its block: 3 mantissa bits (a relative step of
    # 2^-3, half of it in rounding) and, for tiny values, e4m3's subnormal step of 2^-9 times the block's scale
    model = _runner(models["fp8"]).model
    state = load_file(models["float"] / "model.safetensors")
    for name, ours in (
        ("model.layers.1.self_attn.kv_b_proj.weight", model.layers[1].self_attn.kv_b_proj.weight),
        ("model.layers.0.mlp.down_proj.weight", model.layers[0].mlp.down_proj.weight),
    ):
        w = state[name]
        scale = _blockwise(quantize(w, BLOCK)[1], *w.shape)
        err = (ours - w).abs()
        assert (err <= 2**-4 * w.abs() + 2**-10 * scale + 1e-7).all() and err.max() > 0
    dense = _logits(models["float"])
    # and the logits follow the float model's (a routing flip at some position moves that row more)
    assert torch.nn.functional.cosine_similarity(fp8, dense, dim=-1).mean() >= 0.95


def test_block_fp8_feeds_the_int4_path(models):
    logits = _logits(models["fp8"], quantization="int4", dtype="bfloat16")
    exact = _logits(models["exact"], quantization="int4", dtype="bfloat16")
    assert torch.equal(logits, exact)  # the int4 packing sees the same float32 weights either way


def _corrupt(models, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in models["fp8"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_wrong_shaped_scale_is_a_clear_error_naming_the_tensor(models, tmp_path):
    name = "model.layers.1.self_attn.kv_b_proj.weight_scale_inv"

    def edit(state):
        state[name] = state[name][:, :1].contiguous()

    with pytest.raises(ModelLoadError, match=rf"{name} has shape \(20, 1\);.*needs \(20, 2\)"):
        _logits(_corrupt(models, tmp_path, edit))


def test_a_missing_scale_is_a_clear_error(models, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ModelLoadError, match=rf"has {name} but no {name}_scale_inv"):
        _logits(_corrupt(models, tmp_path, lambda state: state.pop(name + "_scale_inv")))


def test_kept_fp8_weights_run_the_triton_gemm_and_match_the_dequantized_load(models, tmp_path):
    """--quantization fp8 keeps the checkpoint's bytes (here through Triton's interpreter, as on a GPU): the linears
    hold Fp8Tensor shards, kv_b_proj stays dense, and the logits equal the dequantized load's. tp=2 shards at block
    boundaries and gives the same greedy output; a shard that would split a block is refused with the reason."""
    from runtime.engine import Engine
    from worker.kernels.fp8_gemm import Fp8Tensor
    from worker.sampling.params import SamplingParams

    kept = _runner(models["fp8"], quantization="fp8")
    attn, mlp = kept.model.layers[1].self_attn, kept.model.layers[1].mlp
    assert isinstance(attn.q_b_proj.qweight, Fp8Tensor) and isinstance(mlp.experts[0].gate_up_proj.qweight, Fp8Tensor)
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.q_b_proj.weight.numel() == 0
    plan = ForwardPlan(1, IDS, [(0, len(IDS), list(range(kept.num_blocks)))], list(range(len(IDS))))
    logits, exact = kept.forward(plan)[0], _logits(models["exact"])
    assert ((logits - exact).abs().max() / exact.abs().max()).item() <= 1e-4
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for folder, quantization, tp in ((models["exact"], "none", 1), (models["fp8"], "fp8", 2)):
        cfg = EngineConfig(model_path=str(folder), dtype="float32", quantization=quantization, tp_size=tp)
        with Engine(cfg.replace(max_total_tokens=256)) as eng:
            outs.append(eng.generate([IDS], greedy)[0].token_ids)
    assert outs[0] == outs[1]
    with pytest.raises(Exception, match="cannot shard this checkpoint: expert rows 8 per rank"):
        Engine(EngineConfig(model_path=str(models["fp8"]), dtype="float32", quantization="fp8", tp_size=4))
