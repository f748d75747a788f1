"""The cost table behind the quantized kernel choice: all 121 linears of one SmolLM2-135M step (30 layers' weights,
cycled so they are not cache-resident) per row count T, in groupwise int4, int8 as two int4 planes, and oneDNN's
prepacked bfloat16, plus the tied 49152-row LM head.

    .venv/bin/python bench/kernels.py [--rows 1,2,3,4,5,6,8,16,64] [--reps 7]

Writes bench/results/kernels.json (medians in ms, with the command and commit).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from provenance import provenance

from worker.quant import int4_linear, pack, quantize_rtn

OUT = Path(__file__).parent / "results"
HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # qkv, o, gate_up, down


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def step_fn(weights, kernel, rows: int):
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTER)}

    def run():
        for layer in weights:
            for w, (_, k) in zip(layer, SHAPES):
                kernel(xs[k], w)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,16,64")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    kernels = {
        "int4": ([[pack(quantize_rtn(w, 4)) for w in layer] for layer in dense],
                 lambda x, w: int4_linear(x, w, None)),
        "int8 (two int4 planes)": ([[pack(quantize_rtn(w, 8)) for w in layer] for layer in dense],
                                   lambda x, w: int4_linear(x, w, None)),
        "bfloat16 oneDNN": ([[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in layer]
                             for layer in dense],
                            lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    }
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.02
    heads = {"int4": pack(quantize_rtn(head, 4)), "int8 (two int4 planes)": pack(quantize_rtn(head, 8)),
             "bfloat16 oneDNN": torch.ops.mkldnn._reorder_linear_weight(head.bfloat16(), 1)}
    table: dict = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        row = {}
        for name, (weights, kernel) in kernels.items():
            row[name] = round(median_ms(step_fn(weights, kernel, rows), args.reps), 2)
            x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
            row[name + " LM head"] = round(median_ms(lambda k=kernel, w=heads[name], x=x: k(x, w), args.reps), 3)
        table[str(rows)] = row
        print(f"T={rows}: " + "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    OUT.mkdir(exist_ok=True)
    result = provenance() | {"unit": "ms, median", "table": table}
    (OUT / "kernels.json").write_text(json.dumps(result, indent=2))
    print(f"results in {OUT / 'kernels.json'}")


if __name__ == "__main__":
    main()
