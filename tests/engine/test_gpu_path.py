"""The GPU step of MoE and latent-attention models, run on CPU with the same code: the Triton backend (kernels in
Triton's interpreter), the fused MoE and the graph path's static buffers (`debug_graph_buffers_on_cpu`). A small
Qwen3-MoE and a small GLM-4.7-Flash-shaped model give the torch reference's greedy tokens, plain and speculative;
routing stays rank 0's at tp=2 under router noise; and no step that a GPU would capture reads a value on the host."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from devtools.models import save_random_eagle_head, save_tiny_model
from runtime.engine import Engine
from worker.config import EngineConfig, SpecConfig
from worker.dist import single_rank_group
from worker.model.config import load_model_config
from worker.model.files import resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner
from worker.sampling.params import SamplingParams

PROMPTS = [[5, 17, 400, 9000, 12, 77, 3], [22, 1534, 7, 900] * 3]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
GPU_PATH = {"attention_backend": "triton", "debug_graph_buffers_on_cpu": True, "cuda_graph_max_rows": 16}
HOST_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smol_dir) -> dict:
    """name -> (folder, spec config, torch-path greedy output)."""
    out = {}
    for arch in ("qwen3_moe", "glm4_moe_lite"):
        layers = 1 if arch == "qwen3_moe" else 2  # GLM-4.7-Flash's first layer is dense: one MoE layer needs two
        folder = save_tiny_model(tmp_path_factory.mktemp(arch), arch, heads=8, kv_heads=4, layers=layers, seed=7)
        if arch == "qwen3_moe":
            head = save_random_eagle_head(folder.parent / "head", load_model_config(resolve_model(str(folder))))
            spec = SpecConfig("EAGLE", str(head), num_steps=2, eagle_topk=1, num_draft_tokens=3, cost_table="off")
        else:  # the checkpoint's MTP layer drafts, a tree (ancestor masks through the latent kernel)
            spec = SpecConfig("EAGLE", None, num_steps=2, eagle_topk=2, num_draft_tokens=4, cost_table="off")
        out[arch] = (folder, spec, _greedy(_config(folder)))
    return out


def _config(folder, **kw) -> EngineConfig:
    return EngineConfig(model_path=str(folder), dtype="float32", max_total_tokens=512, disable_radix_cache=True, **kw)


def _greedy(config: EngineConfig) -> list[list[int]]:
    with Engine(config) as eng:
        out = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
        if config.debug_graph_buffers_on_cpu:
            assert eng.stats.snapshot.graph_replays > 0  # decode and verify steps ran through the static buffers
        return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe_lite"])
def test_the_gpu_path_gives_the_reference_tokens_plain_and_speculative(models, arch):
    folder, spec, reference = models[arch]
    assert _greedy(_config(folder, **GPU_PATH)) == reference
    assert _greedy(_config(folder, spec=spec, **GPU_PATH)) == reference


def test_fused_moe_routing_agrees_at_tp2_under_router_noise(models, tmp_path):
    folder, _, reference = models["qwen3_moe"]
    config = _config(
        folder, tp_size=2, attention_backend="triton", debug_rank_router_noise=5.0, debug_collective_trace=str(tmp_path)
    )
    assert _greedy(config) == reference
    traces = [json.loads(t.read_text()) for t in sorted(tmp_path.glob("rank*.json"))]
    routing = [[e for e in t if e[0] == "moe_routing"] for t in traces]
    assert len(routing) == 2 and routing[0] and routing[0] == routing[1]


class HostSyncError(AssertionError):
    pass


def _forbid_host_syncs(monkeypatch, armed: list[bool]) -> None:
    """Every Tensor method that waits for the device raises while armed, unless Triton's interpreter calls it (on
    CPU it reads tensors through numpy; compiled kernels on a GPU do not)."""
    for name in HOST_SYNCS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if armed[0] and not caller.startswith("triton"):
                raise HostSyncError(f"Tensor.{_name} in a step a GPU would capture (called from {caller})")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "glm4_moe_lite"])
def test_no_host_sync_in_a_captured_step(models, tiny_llama, arch, monkeypatch):
    folder = tiny_llama if arch == "llama" else models[arch][0]
    cfg = _config(folder, **GPU_PATH)
    runner = ModelRunner(cfg, resolve_model(str(folder)), single_rank_group(torch.device("cpu")))
    assert runner.graphs is not None and (runner.fused_moe or arch != "qwen3_moe")
    prompt = PROMPTS[0]
    blocks = list(range(runner.num_blocks))
    runner.forward(ForwardPlan(1, prompt, [(0, len(prompt), blocks)], [len(prompt) - 1]))  # prefill, eagerly
    armed = [False]
    _forbid_host_syncs(monkeypatch, armed)
    body = runner.graphs._body

    def captured(bucket):
        armed[0] = True
        try:
            return body(bucket)
        finally:
            armed[0] = False

    monkeypatch.setattr(runner.graphs, "_body", captured)
    replays = runner.graphs.replays
    logits = runner.forward(ForwardPlan(2, [11], [(len(prompt), 1, blocks)], [0]))[0]  # one decode row
    assert runner.graphs.replays == replays + 1 and torch.isfinite(logits).all()

    # the guard bites: the expert-by-expert MoE path (int4/int8 experts) reads expert ids on the host
    if arch == "qwen3_moe":
        from worker.model.moe import SparseMoE

        for moe in (m for m in runner.model.modules() if isinstance(m, SparseMoE)):
            moe.fused = None
        with pytest.raises(HostSyncError, match="tolist"):
            runner.forward(ForwardPlan(3, [12], [(len(prompt) + 1, 1, blocks)], [0]))
