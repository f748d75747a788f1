"""What a draft forward's linears cost on the CPU by how the head's weights are held: dense bfloat16 (oneDNN,
prepacked) against groupwise int8 and int4 through `qlinear` (this CPU's kernel: exact bfloat16 activations, or
8-bit ones on int8act), on the shipped EAGLE-3 head's shapes (fc over three fused layers, one decoder layer, the
8,192-row draft LM head). Copies of the weights are cycled so each forward reads them from memory, as it does after
a target forward; kinds take turns per repetition.

    .venv/bin/python bench/draft.py [--rows 1,4] [--reps 31] [--machine M]

Writes bench/results/draft[-MACHINE].json (medians in ms, with the command and commit).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from devtools.provenance import add_machine_option, provenance, result_path
from worker.kernels.quant import int4_linear, pack, quantize_rtn

H, INTER, DRAFT_VOCAB = 576, 1536, 8192
SHAPES = [(H, 3 * H), (H + 2 * 192, 2 * H), (H, H), (2 * INTER, H), (H, INTER), (DRAFT_VOCAB, H)]  # fc .. lm_head
COPIES = 6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--reps", type=int, default=31)
    add_machine_option(ap)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.02 for n, k in SHAPES] for _ in range(COPIES)]
    onednn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")  # noqa: E731
    qlinear = lambda x, w: int4_linear(x, w, None)  # noqa: E731
    kinds = {
        "bfloat16 oneDNN": (
            [[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) for w in c] for c in dense],
            onednn,
        ),
        "int8 qlinear": ([[pack(quantize_rtn(w, 8)) for w in c] for c in dense], qlinear),
        "int4 qlinear": ([[pack(quantize_rtn(w, 4)) for w in c] for c in dense], qlinear),
    }
    table: dict[str, dict[str, float]] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for rep in range(args.reps):
            for name, (weights, run) in kinds.items():
                t0 = time.perf_counter()
                for (_, k), w in zip(SHAPES, weights[rep % COPIES]):
                    run(xs[k], w)
                times[name].append((time.perf_counter() - t0) * 1e3)
        table[str(rows)] = {name: round(sorted(t)[len(t) // 2], 3) for name, t in times.items()}
        print(rows, table[str(rows)], flush=True)
    mb = {
        "bfloat16 oneDNN": sum(n * k * 2 for n, k in SHAPES) / 1e6,
        "int8 qlinear": sum(w.nbytes for w in kinds["int8 qlinear"][0][0]) / 1e6,
        "int4 qlinear": sum(w.nbytes for w in kinds["int4 qlinear"][0][0]) / 1e6,
    }
    out = provenance() | {"unit": "ms, median, all of one draft forward's linears", "weight MB": mb, "table": table}
    result_path("draft", args.machine).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
