"""The cost table behind the quantized kernel choice: all 121 linears of one SmolLM2-135M step (30 layers' weights,
cycled so they are not cache-resident) per row count T, in groupwise int4 and int8 on our `qlinear` and on torch's
int4 kernel (int8 as two int4 planes), and oneDNN's prepacked bfloat16, plus the tied 49152-row LM head. Kernels
take turns within each repetition, so the machine's drift falls on all of them alike.

    .venv/bin/python bench/kernels.py [--rows 1,2,3,4,5,6,8,16,64] [--reps 7] [--machine epyc]

Writes bench/results/kernels[-MACHINE].json (medians in ms, with the command and commit).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from devtools.provenance import add_machine_option, provenance, result_path
from worker.kernels import cpu as cpu_kernels
from worker.kernels import cpu_choice
from worker.kernels.quant import int4_linear, pack_blocks, pack_int4, quantize_rtn

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down


def step_fn(weights, kernel, rows: int):
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def run():
        for layer in weights:
            for w, (_, k) in zip(layer, SHAPES):
                kernel(xs[k], w)

    return run


def timed_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16,64")
    ap.add_argument("--reps", type=int, default=7)
    add_machine_option(ap)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    int4 = [[quantize_rtn(w, 4) for w in layer] for layer in dense]
    int8 = [[quantize_rtn(w, 8) for w in layer] for layer in dense]
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.02
    head4, head8 = quantize_rtn(head, 4), quantize_rtn(head, 8)
    run = lambda x, w: int4_linear(x, w, None)  # noqa: E731 - both layouts go through the serving entry point
    blocks = lambda qt, layout="bf16": pack_blocks(qt, torch.bfloat16, layout)  # noqa: E731
    onednn = lambda w: torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1)  # noqa: E731
    kernels = {}  # name: (step weights, head weight, kernel)
    ops = cpu_kernels.ops(torch.device("cpu"))
    built = cpu_choice.built()
    if "int8act" in built:  # 8-bit activations by integer dot products (AVX512-VNNI or AVX2)
        for bits, qts, head_q in ((4, int4, head4), (8, int8, head8)):
            packed = [[blocks(q, "int8act") for q in layer] for layer in qts]
            kernels[f"qlinear int8act int{bits}"] = (packed, blocks(head_q, "int8act"), run)
    if "bf16" in built:
        kernels["qlinear int4"] = ([[blocks(q) for q in layer] for layer in int4], blocks(head4), run)
        kernels["qlinear int8"] = ([[blocks(q) for q in layer] for layer in int8], blocks(head8), run)
        if ops.qlinear_amx():  # every row count takes AMX tiles here; time the dot-product path beside them

            def vector_only(x, w):
                ops.set_qlinear_amx(False)
                try:
                    return run(x, w)
                finally:
                    ops.set_qlinear_amx(True)

            kernels["qlinear int4 (no AMX)"] = (kernels["qlinear int4"][0], kernels["qlinear int4"][1], vector_only)
    else:
        print("qlinear's AVX512-BF16 path is not built on this machine: timing the other kernels only")
    kernels |= {
        "torch int4": ([[pack_int4(q) for q in layer] for layer in int4], pack_int4(head4), run),
        "torch int8 (two int4 planes)": ([[pack_int4(q) for q in layer] for layer in int8], pack_int4(head8), run),
        "bfloat16 oneDNN": (
            [[onednn(w) for w in layer] for layer in dense],
            onednn(head),
            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        ),
    }
    table: dict = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
        fns = {}
        for name, (weights, head_w, kernel) in kernels.items():
            fns[name] = step_fn(weights, kernel, rows)
            fns[name + " LM head"] = lambda k=kernel, w=head_w: k(x, w)
        times: dict = {name: [] for name in fns}
        for rep in range(args.reps + 1):  # the first round warms up
            for name, fn in fns.items():
                t = timed_ms(fn)
                if rep:
                    times[name].append(t)
        row = {name: round(sorted(t)[len(t) // 2], 3 if "head" in name else 2) for name, t in times.items()}
        table[str(rows)] = row
        print(f"T={rows}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    result = provenance() | {"unit": "ms, median", "table": table}
    path = result_path("kernels", args.machine)
    path.write_text(json.dumps(result, indent=2))
    print(f"results in {path}")


if __name__ == "__main__":
    main()
