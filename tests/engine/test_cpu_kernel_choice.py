"""`--cpu-kernel`: every CPU kernel this machine runs (and, passing for an AVX2-only CPU, the `-march=haswell` build's
AVX2 kernel) serves the default model with the shipped head, its speculative output identical to its plain output;
the choice shows in /engine/stats; forcing a kernel the CPU (or build) lacks stops start-up with a message naming
the missing feature; bfloat16 serves where torch's oneDNN bfloat16 linear does not run."""

from __future__ import annotations

import dataclasses

import pytest

from devtools.prompts import chat
from runtime.engine import Engine, EngineDeadError
from speculative.defaults import default_spec_config
from worker.config import EngineConfig
from worker.kernels import cpu_choice
from worker.sampling.params import SamplingParams

AVX2_CLASS = {"EAGLEGATE_CPU_CLASS": "avx2"}  # the -march=haswell build, torch capped at AVX2, no oneDNN bfloat16
QUESTIONS = ["Explain why the sky is blue.", "Write a haiku about rain.", "List three uses of copper."]
# name: (--cpu-kernel, extra environment of the worker processes, what /engine/stats then names)
VARIANTS = {
    "bf16": ("bf16", {}, None),
    "int8act": ("int8act", {}, None),
    "int8act, AVX2 class": ("int8act", AVX2_CLASS, "int8act (avx2)"),
    # bfloat16 activations and the head's dense linears where oneDNN's bfloat16 linear is refused
    "portable, AVX2 class": ("portable", AVX2_CLASS, "portable (torch int4 kernel)"),
}


def _skip_reason(variant: str) -> str | None:
    kernel, env, _ = VARIANTS[variant]
    if env:
        if "avx2" not in cpu_choice.cpu_flags():
            return "needs AVX2 to run the -march=haswell build"
        if kernel == "int8act" and cpu_choice.built().get("int8act") == "avx2":
            return "needs AVX-512 in the native build: without it, the native build is the AVX2 one ('int8act')"
        return None
    if kernel == "bf16" and "bf16" not in cpu_choice.built():
        return "needs AVX512-BF16: the bf16 kernel does not run on this CPU"
    if kernel == "int8act" and "int8act" not in cpu_choice.built():
        return "needs AVX2: no integer-activation kernel runs on this CPU"
    return None


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculative_output_is_plain_output_on_each_cpu_kernel(variant, smol_dir, monkeypatch):
    reason = _skip_reason(variant)
    if reason:
        pytest.skip(reason)
    kernel, env, shown = VARIANTS[variant]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # each kernel's served numerics (int8act: float32 activations); portable where auto would be float32 and dense
    dtype = "bfloat16" if kernel == "portable" else "auto"
    cfg = EngineConfig(dtype=dtype, quantization="auto", cpu_kernel=kernel, max_total_tokens=4096)
    spec = dataclasses.replace(default_spec_config(), cost_table="off")  # draft on every step
    params = SamplingParams(max_new_tokens=24, temperature=0)
    runs = {}
    for name, c in (("plain", cfg), ("spec", cfg.replace(spec=spec))):
        with Engine(c) as eng:
            prompts = [eng.encode(chat(eng, q)) for q in QUESTIONS]
            runs[name] = [eng.generate([p], params)[0].token_ids for p in prompts]  # batch 1, as served
            stats = dict(eng.stats.values)
        assert stats["cpu_kernel"] == (shown or str(cpu_choice.resolve(kernel)))
    assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
    assert runs["spec"] == runs["plain"]


def test_forcing_a_cpu_kernel_the_build_lacks_stops_start_up_naming_the_feature(smol_dir, monkeypatch):
    if "avx2" not in cpu_choice.cpu_flags():
        pytest.skip("needs AVX2 to run the -march=haswell build")
    for k, v in AVX2_CLASS.items():  # no AVX512-BF16 in that build
        monkeypatch.setenv(k, v)
    with pytest.raises(EngineDeadError, match=r"--cpu-kernel bf16 needs the CPU feature avx512_bf16\+avx512bw"):
        Engine(EngineConfig(dtype="bfloat16", cpu_kernel="bf16", max_total_tokens=1024))


def test_bfloat16_serves_where_onednns_bfloat16_linear_is_refused(tiny_llama, monkeypatch):
    """torch's oneDNN bfloat16 linear needs AVX512BW (or AVX-NE-CONVERT): passing for an AVX2-only CPU, a dense model
    in bfloat16 keeps its weights unpacked and F.linear serves them, giving the packed path's greedy tokens."""
    if "avx2" not in cpu_choice.cpu_flags():
        pytest.skip("needs AVX2 to run the -march=haswell build")
    cfg = EngineConfig(model_path=str(tiny_llama), dtype="bfloat16", max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9, 200 + i, 77] for i in range(3)]
    runs = {}
    for name, env in (("as this CPU serves", {}), ("AVX2 class", AVX2_CLASS)):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with Engine(cfg) as eng:
            runs[name] = [o.token_ids for o in eng.generate(prompts, params)]
    assert all(len(t) == 12 for t in runs["AVX2 class"])
    assert runs["AVX2 class"] == runs["as this CPU serves"]
