"""Prefill attention on the CPU: one causal chunk through the fused row-wise kernel (`attend_rows`, every row over a
prefix of the chunk's key list, the path that gives a position the same bits however its prompt was split) against
torch's SDPA with a causal mask, on the native build and the AVX2 (`-march=haswell`) build, each in a process of its
own (the AVX2 one as `make test-cpu CLASS=avx2` runs it). Heads as query heads x KV heads x head size: SmolLM2-135M's
9x3x64 and a Llama-3-8B-like 32x8x128; a bfloat16 cache, float32 arithmetic.

    .venv/bin/python bench/attention.py [--shapes 9x3x64,32x8x128] [--lengths 512,2048] [--reps 5] [--machine epyc]

Writes bench/results/attention[-MACHINE].json (medians in ms, with the command and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from devtools.provenance import add_machine_option, provenance, result_path

# the AVX2 class (worker/kernels/cpu_class.py): the -march=haswell build, torch's dispatch and oneDNN capped at AVX2
BUILDS = {
    "native": {},
    "avx2": {"EAGLEGATE_CPU_CLASS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def measure(shapes: list[tuple[int, int, int]], lengths: list[int], reps: int) -> dict:
    """Median ms of both paths per shape and chunk length, in this process's build (they take turns within a
    repetition)."""
    from worker.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.ops(torch.device("cpu"))
    out = {}
    for (heads, kv_heads, head_dim), n in ((shape, n) for shape in shapes for n in lengths):
        g = torch.Generator().manual_seed(n)
        q = torch.randn(n, heads, head_dim, generator=g)
        k_cache = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
        v_cache = torch.randn(n, kv_heads, head_dim, generator=g).bfloat16()
        keys, counts = torch.arange(n).view(1, n), torch.arange(1, n + 1)
        mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)
        scale = head_dim**-0.5

        def rows():
            kernels.attend_rows(q, k_cache, v_cache, keys, counts, scale, torch.bfloat16)

        def sdpa():
            k = k_cache.float().transpose(0, 1).unsqueeze(0)
            v = v_cache.float().transpose(0, 1).unsqueeze(0)
            F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, scale=scale, enable_gqa=True
            )

        times = {"attend_rows": [], "sdpa": []}
        for _ in range(reps + 1):  # the first round warms up
            for name, fn in (("attend_rows", rows), ("sdpa", sdpa)):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        out[f"{heads}x{kv_heads}x{head_dim} {n}"] = {
            name: round(sorted(t[1:])[len(t[1:]) // 2], 2) for name, t in times.items()
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="9x3x64,32x8x128")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_machine_option(p)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    if args.child:
        print(json.dumps(measure(shapes, lengths, args.reps)))
        return
    result = provenance() | {"unit": "ms, median; keys: heads x KV heads x head size, chunk rows", "builds": {}}
    for build, env in BUILDS.items():
        cmd = [sys.executable, __file__, "--child", "--shapes", args.shapes, "--lengths", args.lengths]
        cmd += ["--reps", str(args.reps)]
        r = subprocess.run(cmd, env=os.environ | env, capture_output=True, text=True, check=True)
        result["builds"][build] = json.loads(r.stdout.strip().splitlines()[-1])
        print(build, result["builds"][build])
    path = result_path("attention", args.machine)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
