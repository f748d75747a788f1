"""On a GPU (run by scripts/gpu-check.sh; skipped in CI): the CUDA path against the CPU float32 reference, graph
replay against eager, and EAGLE lossless with captured verify steps. Models are small random Llamas built here
with transformers, so the check needs no weights carried to the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine import Engine
from worker.config import EngineConfig, SpecConfig
from worker.sampling.params import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = [[5, 17, 400, 9000, 12, 77, 3], [22, 1534, 7, 900], [9, 9, 9, 9, 100, 200, 300, 400, 500, 600, 700]]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_llama(tmp_path_factory) -> Path:
    from devtools.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("gpu-llama"), "llama", heads=8, kv_heads=4, layers=3)


def _generate(folder: Path, **kw) -> tuple[list[list[int]], int]:
    cfg = EngineConfig(model_path=str(folder), max_total_tokens=2048, disable_radix_cache=True, **kw)
    with Engine(cfg) as eng:
        out = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
        return out, eng.stats.snapshot.graph_replays


@pytest.fixture(scope="module")
def cpu_reference(gpu_llama) -> list[list[int]]:
    return _generate(gpu_llama, device="cpu", dtype="float32")[0]


def test_gpu_float32_greedy_matches_the_cpu_reference_eager_and_captured(gpu_llama, cpu_reference):
    captured, replays = _generate(gpu_llama, device="cuda", dtype="float32")
    assert captured == cpu_reference and replays > 0
    eager, replays = _generate(gpu_llama, device="cuda", dtype="float32", enforce_eager=True)
    assert eager == cpu_reference and replays == 0


def test_captured_bfloat16_logits_match_eager(gpu_llama):
    """A replay runs the bucket's padded row count, so cuBLAS may pick other kernels than for the eager row count:
    bfloat16 logits agree to rounding, not bit for bit (float32 greedy output is compared exactly above)."""
    import torch

    from worker.dist import single_rank_group
    from worker.model.files import resolve_model
    from worker.protocol import ForwardPlan
    from worker.runner import ModelRunner

    cfg = EngineConfig(model_path=str(gpu_llama), device="cuda", dtype="bfloat16", max_total_tokens=256)
    runner = ModelRunner(cfg, resolve_model(str(gpu_llama)), single_rank_group(torch.device("cuda", 0)))
    ids = PROMPTS[2]  # 11 rows: replayed from the 16-row graph
    plan = ForwardPlan(1, ids, [(0, len(ids), list(range(runner.num_blocks)))], list(range(len(ids))))
    captured = runner.forward(plan)[0].clone()
    assert runner.graphs is not None and runner.graphs.replays == 1
    graphs, runner.graphs = runner.graphs, None  # the same plan eagerly (it rewrites the same KV slots)
    eager = runner.forward(plan)[0]
    runner.graphs = graphs
    assert ((captured - eager).abs().max() / eager.abs().max()).item() < 2e-2
    assert (captured.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.9


def test_eagle_on_gpu_with_captured_verify_is_lossless(gpu_llama, cpu_reference, tmp_path):
    from devtools.models import save_random_eagle_head
    from worker.model.config import load_model_config
    from worker.model.files import resolve_model

    head = save_random_eagle_head(tmp_path / "head", load_model_config(resolve_model(str(gpu_llama))), "eagle3")
    spec = SpecConfig("EAGLE3", str(head), num_steps=3, eagle_topk=2, num_draft_tokens=6, cost_table="off")
    out, replays = _generate(gpu_llama, device="cuda", dtype="float32", spec=spec)
    assert out == cpu_reference and replays > 0


def test_block_fp8_gemm_on_the_gpu_matches_dequantized_float32():
    import torch

    from worker.kernels.fp8_gemm import Fp8Tensor, fp8_linear
    from worker.model.fp8 import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    for m in (1, 16, 200):
        w = torch.randn(512, 384, generator=g)
        codes, scale = quantize(w, (128, 128))
        x = torch.randn(m, 384, generator=g).bfloat16()
        out = fp8_linear(x.cuda(), Fp8Tensor(codes.cuda(), scale.cuda(), (128, 128))).float().cpu()
        ref = x.float() @ dequantize("w", codes, scale, (128, 128)).T
        assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-2


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe_lite"])
def test_moe_and_latent_attention_captured_on_the_gpu_match_eager_and_the_cpu(tmp_path, arch):
    """Fused MoE (and for GLM-4.7-Flash's shape the Triton latent attention) on the GPU: float32 greedy output
    captured equals eager equals the CPU's; drafting with the MTP layer keeps it."""
    from devtools.models import save_tiny_model

    folder = save_tiny_model(tmp_path, arch, heads=8, kv_heads=8 if "lite" in arch else 4, layers=3, seed=5)
    cpu = _generate(folder, device="cpu", dtype="float32")[0]
    captured, replays = _generate(folder, device="cuda", dtype="float32")
    assert captured == cpu and replays > 0
    eager, replays = _generate(folder, device="cuda", dtype="float32", enforce_eager=True)
    assert eager == cpu and replays == 0
    if "lite" in arch:
        spec = SpecConfig("EAGLE", None, num_steps=2, eagle_topk=2, num_draft_tokens=6, cost_table="off")
        assert _generate(folder, device="cuda", dtype="float32", spec=spec)[0] == cpu
