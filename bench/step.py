"""Where a decode (or verify) step's time goes, measured in place: the step with one kind of work removed at a time.

    .venv/bin/python bench/step.py [--context 300] [--rows 1,2,3,6] [--rounds 20] [--machine M]

A profiler's per-op figures are inflated by its own overhead and miss what small ops cost in place (cold caches
after a large matmul, dispatch), so this times the whole target forward plus LM head (in process, no HTTP, the
served bfloat16/int4 weights; each layer one `decoder_layer` kernel call) against the same step with the layer's ops
called one by one from Python ("unfused"), and, unfused, with the RMSNorms made identities, with attention skipped
(the rotary and cache write stay), or with every linear replaced by a lookup of its earlier output. Each difference
from the unfused step is that work's cost inside a real step. It also times the step with the fused CPU kernels
(worker/kernels/csrc/cpu_kernels.cpp) turned off, the eager torch ops they replace (the linears stay on `qlinear`),
and with the linears on torch's int4 kernel instead of `qlinear` (the same codes), and, where the CPU has AMX tiles,
with `qlinear` on its dot-product path instead ("no AMX"). The variants are run round-robin so machine noise spreads
over all of them. Writes bench/results/step[-MACHINE].json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import worker.model.causal_lm as model
import worker.model.layers as layers
from devtools.provenance import add_machine_option, provenance, result_path
from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.kernels import cpu as cpu_kernels
from worker.kernels.quant import QBlocks, pack_int4
from worker.model.files import fetch_default_model, resolve_model
from worker.model.seq_slice import SeqSlice
from worker.runner import ModelRunner


def _no_norm(self, x):
    return x


def _no_norm_after_add(self, x, delta):
    x = x + delta
    return x, x


def _no_attention(q, k, v, k_cache, v_cache, meta, scale):
    return q


def _no_rotated_attention(kernels, q, k_cache, v_cache, meta, scale, dtype):
    return q.to(dtype)


def _replayed_linear(real):
    seen: dict = {}

    def linear(x, mod):
        key = (id(mod), x.shape[0])
        if key not in seen:
            seen[key] = real(x, mod)
        return seen[key]

    return linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=300, help="cached tokens behind the step")
    ap.add_argument("--rows", default="1,2,3,6", help="query rows per step (1: decode; more: a verify tree)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    add_machine_option(ap)
    args = ap.parse_args()
    config = EngineConfig(dtype="bfloat16", max_total_tokens=4096)
    source = resolve_model(str(fetch_default_model(quiet=True)))
    runner = ModelRunner(config, source, TPGroup(0, 1, torch.device("cpu")))
    ctx = args.context
    table = list(range(-(-(ctx + 64) // config.block_size)))
    real = (
        layers.RMSNorm.forward,
        layers.RMSNorm.after_add,
        model.attend,
        model.attend_rotated,
        layers.linear,
        cpu_kernels.ops(torch.device("cpu")),
    )

    def unfused() -> None:
        model.FUSED_LAYERS = False

    def no_norm() -> None:
        unfused()
        layers.RMSNorm.forward, layers.RMSNorm.after_add = _no_norm, _no_norm_after_add

    def no_attention() -> None:
        unfused()
        model.attend, model.attend_rotated = _no_attention, _no_rotated_attention

    def no_linears() -> None:
        unfused()
        layers.linear = _replayed_linear(real[4])

    variants = {
        "full step": lambda: None,
        "unfused step": unfused,
        "eager ops": lambda: setattr(cpu_kernels, "_module", None),
        "without RMSNorm": no_norm,
        "without attention": no_attention,
        "without linears": no_linears,
    }

    ours = {mod: mod.qweight for mod in runner.model.modules() if isinstance(getattr(mod, "qweight", None), QBlocks)}
    theirs = {mod: pack_int4(w.qtensor(), w.dtype) for mod, w in ours.items()}
    if ours:
        variants["torch int4"] = lambda: [setattr(mod, "qweight", w) for mod, w in theirs.items()]
    kernels = real[5]
    amx = kernels is not None and kernels.qlinear_amx()
    if amx:  # every step runs on AMX tiles here unless they are turned off
        variants["no AMX"] = lambda: kernels.set_qlinear_amx(False)

    def restore() -> None:
        (
            layers.RMSNorm.forward,
            layers.RMSNorm.after_add,
            model.attend,
            model.attend_rotated,
            layers.linear,
            cpu_kernels._module,
        ) = real
        model.FUSED_LAYERS = True
        if amx:
            kernels.set_qlinear_amx(True)
        for mod, w in ours.items():
            mod.qweight = w

    results: dict = {}
    with torch.inference_mode():
        runner.run_model([(i * 7919) % 40000 + 100 for i in range(ctx)], list(range(ctx)), [SeqSlice(0, ctx, table)])
        for rows in [int(r) for r in args.rows.split(",")]:
            ids, positions = [5] * rows, list(range(ctx, ctx + rows))

            def step() -> float:
                t0 = time.perf_counter()
                hidden, _, _ = runner.run_model(ids, positions, [SeqSlice(ctx, rows, table)])
                runner.model.compute_logits(hidden).float()
                return time.perf_counter() - t0

            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, apply in variants.items():
                    apply()
                    step()  # the first step of a variant fills the replay table
                    times[name] += [step() for _ in range(args.steps)]
                    restore()
            ms = {name: round(1000 * statistics.median(t), 2) for name, t in times.items()}
            full, eager, torch_int4 = ms.pop("full step"), ms.pop("eager ops"), ms.pop("torch int4", None)
            no_amx = ms.pop("no AMX", None)
            one_by_one = ms.pop("unfused step")
            parts = {name.removeprefix("without ") + " ms": round(one_by_one - v, 2) for name, v in ms.items()}
            # the remainder of the unfused step: embedding, rotary, residual adds, SiLU, attention metadata, dispatch
            results[str(rows)] = (
                {
                    "step ms": full,
                    "unfused step ms": one_by_one,
                    "eager step ms": eager,
                    "torch int4 step ms": torch_int4,
                    "no AMX step ms": no_amx,
                }
                | parts
                | {"rest ms": round(one_by_one - sum(parts.values()), 2)}
            )
            print(f"rows {rows}: " + ", ".join(f"{k} {v}" for k, v in results[str(rows)].items()), flush=True)
    out = provenance() | {
        "context": ctx,
        "unit": "ms, median; each part is the full step minus the step without it",
        "rows": results,
    }
    path = result_path("step", args.machine)
    path.write_text(json.dumps(out, indent=2))
    print(f"results in {path}")


if __name__ == "__main__":
    main()
