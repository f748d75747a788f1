"""What int8 activations would buy a verify row on a CPU without AMX: the shipped `qlinear` (int4 weights, exact
bfloat16 activations, AVX512-BF16 dot products) against a prototype (bench/vnni_int4.cpp: the same int4 codes, each
row's activations quantized to int8 per group of 32, AVX512-VNNI dot products), on the 120 int4 linears of one
SmolLM2-135M step (30 layers' weights, cycled so they are not cache-resident) per row count; and what the int8
activations cost in accuracy on the default model's own activations.

Accuracy: one real prompt and answer teacher-forced through the default int4 model (unfused layers), every int4
linear once on `qlinear` and once on the prototype: the relative error of each linear's output against float32
(the same dequantized weights, float32 activations), and how often the two ways agree on the next token.

    .venv/bin/python bench/vnni.py [--rows 1,2,3,4,6,8] [--reps 25]

Writes bench/results/vnni.json (medians in ms, with the command and commit). Needs AVX512-VNNI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from kernels import HIDDEN, INTER, LAYERS, SHAPES  # one SmolLM2-135M step's linears, as bench/kernels.py times them
from provenance import provenance
from torch.utils.cpp_extension import load

import worker.model.causal_lm as model
import worker.model.layers as layers
from training.train_data import chat_ids
from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.kernels.quant import GROUP, QBlocks, QTensor, int4_linear, pack_blocks, quantize_rtn
from worker.model.files import fetch_default_model, resolve_model
from worker.model.seq_slice import SeqSlice
from worker.model.tokenizer import load_tokenizer
from worker.runner import ModelRunner

HERE = Path(__file__).parent
OUT = HERE / "results"
PROMPT = "Explain in a few paragraphs why the sky is blue and why sunsets are red."


def build():
    cache = Path(os.environ.get("EAGLEGATE_CACHE", HERE.parent / ".cache")) / "vnni_proto"
    cache.mkdir(parents=True, exist_ok=True)
    return load(name="eaglegate_vnni_proto", sources=[str(HERE / "vnni_int4.cpp")], build_directory=str(cache),
                extra_cflags=["-O3", "-march=native", "-fopenmp"])


def vnni_layout(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_offset) for the prototype: see bench/vnni_int4.cpp. Rows padded to blocks of 16."""
    n, k = qt.shape
    blocks, groups, pad = -(-n // 16), k // GROUP, -n % 16
    q = torch.cat([qt.q, torch.zeros(pad, k, dtype=qt.q.dtype)]) if pad else qt.q
    q = q.view(blocks, 16, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # block, group, u, low/high, lane, input
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).to(torch.uint8).contiguous().view(blocks, groups, 4, 64)
    scale_offset = pack_blocks(qt, torch.bfloat16).scale_offset
    return codes, scale_offset


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's activations as int8 per group of 32 (absmax / 127), the groups' scales, the groups' exact sums."""
    m, k = x.shape
    g = x.float().view(m, k // GROUP, GROUP)
    scale = g.abs().amax(-1).clamp(min=1e-30) / 127
    xq = torch.round(g / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(m, k)
    return xq, scale.contiguous(), g.sum(-1).contiguous()


def vnni_linear(ext, x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor], out_features: int) -> torch.Tensor:
    codes, scale_offset = w
    y = ext.qlinear_vnni(*quantize_rows(x.reshape(-1, x.shape[-1])), codes, scale_offset, codes.shape[0] * 16)
    return y[:, :out_features].to(x.dtype).view(*x.shape[:-1], out_features)


def speed(ext, rows_list: list[int], reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    qts = [[quantize_rtn(torch.randn(n, k, generator=g) * 0.02, 4) for n, k in SHAPES] for _ in range(LAYERS)]
    shipped = [[pack_blocks(qt, torch.bfloat16) for qt in layer] for layer in qts]
    proto = [[vnni_layout(qt) for qt in layer] for layer in qts]
    table = {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (HIDDEN, INTER)}
        xq = {k: quantize_rows(x) for k, x in xs.items()}

        def run_shipped():
            for layer in shipped:
                for w, (_, k) in zip(layer, SHAPES):
                    int4_linear(xs[k], w, None)

        def run_proto():
            for layer in proto:
                for (codes, so), (n, k) in zip(layer, SHAPES):
                    ext.qlinear_vnni(*xq[k], codes, so, n)

        times = {"qlinear bf16 activations": [], "int8 activations (VNNI)": []}
        for rep in range(reps + 3):
            for name, fn in zip(times, (run_shipped, run_proto)):
                t0 = time.perf_counter()
                fn()
                if rep >= 3:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        table[str(rows)] = {name: round(statistics.median(t), 3) for name, t in times.items()}
        print(rows, table[str(rows)], flush=True)
    return table


def accuracy(ext) -> dict:
    config = EngineConfig(dtype="bfloat16", max_total_tokens=2048)
    source = resolve_model(str(fetch_default_model(quiet=True)))
    runner = ModelRunner(config, source, TPGroup(0, 1, torch.device("cpu")))
    tok = load_tokenizer(source)
    ids = list(chat_ids(tok, [{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    errors: dict[str, list[float]] = {"qlinear bf16 activations": [], "int8 activations (VNNI)": []}
    layouts: dict[int, tuple] = {}
    use_proto = [False]
    real = layers.int4_linear

    def patched(x, w, bias):
        if not (isinstance(w, QBlocks) and w.bits == 4):
            return real(x, w, bias)
        key = id(w)
        if key not in layouts:
            qt = w.qtensor()
            layouts[key] = (vnni_layout(qt), qt.dequantize().float())
        proto, dense = layouts[key]
        ref = x.float() @ dense.t()
        ours = real(x, w, bias)
        alt = vnni_linear(ext, x, proto, w.out_features)
        for name, y in zip(errors, (ours, alt)):
            errors[name].append(float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)))
        return alt if use_proto[0] else ours

    def forward(seq: list[int]) -> torch.Tensor:
        n = len(seq)
        hidden, _, _ = runner.run_model(seq, list(range(n)), [SeqSlice(0, n, list(range(-(-n // runner.block_size))))])
        return runner.model.compute_logits(hidden).float()

    with torch.inference_mode():
        seq = list(ids)  # the model's own greedy answer, on the shipped path
        for _ in range(96):
            seq.append(int(forward(seq)[-1].argmax()))
        layers.int4_linear, model.FUSED_LAYERS = patched, False
        try:
            tops = []
            for proto in (False, True):  # both paths teacher-forced over prompt + answer
                use_proto[0] = proto
                tops.append(forward(seq))
        finally:
            layers.int4_linear, model.FUSED_LAYERS = real, True
    answer = slice(len(ids) - 1, len(seq) - 1)
    agree = (tops[0][answer].argmax(-1) == tops[1][answer].argmax(-1)).float().mean()
    return {"positions": len(seq) - len(ids),
            "next token agrees (int8 activations vs bfloat16)": round(float(agree), 4),
            "max logit difference": round(float((tops[0][answer] - tops[1][answer]).abs().max()), 4),
            "linear relative error vs float32 (median, max)":
                {name: [round(statistics.median(v), 5), round(max(v), 5)] for name, v in errors.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8")
    ap.add_argument("--reps", type=int, default=25)
    args = ap.parse_args()
    torch.manual_seed(0)
    ext = build()
    table = speed(ext, [int(r) for r in args.rows.split(",")], args.reps)
    acc = accuracy(ext)
    print(acc, flush=True)
    OUT.mkdir(exist_ok=True)
    out = provenance() | {"unit": "ms, median, the 120 int4 linears of one step", "table": table, "accuracy": acc}
    (OUT / "vnni.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
