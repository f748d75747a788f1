"""Per verify step: mean accept length, draft and verify time, and the rank-0 decision broadcast latency, at
tp=1 and tp=2; plus the packed decision broadcast (one tensor) against three separate broadcasts on gloo.

    .venv/bin/python bench/spec_sync.py [--iters 2000] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.dist import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _bcast_worker(rank: int, port: int, iters: int, batch: int, steps: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    packed = torch.zeros(batch, 2 + steps, dtype=torch.int64)
    lens, bonus, path = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64), \
        torch.zeros(batch, steps, dtype=torch.int64)
    one, three = [], []
    for i in range(iters + 50):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(packed, 0)
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        dist.broadcast(lens, 0)
        dist.broadcast(bonus, 0)
        dist.broadcast(path, 0)
        t3 = time.perf_counter()
        if i >= 50:
            one.append(t1 - t0)
            three.append(t3 - t2)
    if rank == 0:
        out.put((one, three))
    dist.destroy_process_group()


def broadcast_bench(iters: int, batch: int, steps: int) -> tuple[list[float], list[float]]:
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_bcast_worker, args=(r, port, iters, batch, steps, q)) for r in range(2)]
    for p in procs:
        p.start()
    one, three = q.get()
    for p in procs:
        p.join()
    return one, three


def engine_bench(config, prompts, max_tokens: int) -> dict:
    from runtime.engine import Engine
    from worker.sampling.params import SamplingParams

    collected: dict[str, list[float]] = {}

    def on_step(report) -> None:
        m = report.step_metrics
        collected.setdefault("accept_lengths", []).extend(m.accept_lengths)
        for phase in ("draft", "verify"):
            collected.setdefault(f"{phase}_phase", []).extend(m.phase_seconds.get(phase, ()))
        for kind in ("verify", "draft", "control"):
            collected.setdefault(f"{kind}_sync", []).extend(m.sync_seconds.get(kind, ()))

    with Engine(config, on_step=on_step) as eng:
        ids = [eng.encode(p) if isinstance(p, str) else p for p in prompts]
        eng.generate(ids[:1], SamplingParams(max_new_tokens=8, temperature=0))
        collected.clear()
        eng.generate(ids, SamplingParams(max_new_tokens=max_tokens, temperature=0, ignore_eos=True))
    med = lambda xs: statistics.median(xs) * 1000 if xs else float("nan")  # noqa: E731
    return {"accept_length": statistics.mean(collected.get("accept_lengths") or [float("nan")]),
            "draft_ms": med(collected.get("draft_phase", [])),
            "verify_ms": med(collected.get("verify_phase", [])),
            "verify_sync_ms": med(collected.get("verify_sync", [])),
            "draft_sync_ms": med(collected.get("draft_sync", [])),
            "control_sync_ms": med(collected.get("control_sync", []))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    one, three = broadcast_bench(args.iters, args.batch, args.steps)
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))] * 1000  # noqa: E731
    print(f"gloo, 2 ranks, batch {args.batch}, {args.iters} iterations:")
    print(f"  one packed broadcast   p50 {q(one, .5):.3f} ms  p90 {q(one, .9):.3f} ms")
    print(f"  three broadcasts       p50 {q(three, .5):.3f} ms  p90 {q(three, .9):.3f} ms  "
          f"(packed is {q(three, .5) / q(one, .5):.2f}x faster at p50)")

    from helpers import save_copy_eagle_head, save_tiny_model

    from speculative.defaults import DEFAULT_HEAD
    from worker.config import EngineConfig, SpecConfig
    from worker.model.config import load_model_config
    from worker.model.files import fetch_default_model, resolve_model

    fetch_default_model(quiet=True)
    prompts = ["Explain photosynthesis.", "Write a poem about rivers.", "What is a prime number?",
               "Describe Paris in three sentences."]
    head = str(DEFAULT_HEAD) if (DEFAULT_HEAD / "model.safetensors").exists() else None
    with tempfile.TemporaryDirectory() as tmp:
        if head is None:
            head = str(save_copy_eagle_head(Path(tmp) / "copy", load_model_config(resolve_model(
                "smollm2-135m-instruct"))))
        spec = SpecConfig("EAGLE", head, num_steps=args.steps, eagle_topk=1, num_draft_tokens=args.steps + 1)
        r1 = engine_bench(EngineConfig(dtype="bfloat16", max_total_tokens=8192, spec=spec), prompts, args.max_tokens)
        # tp=2 needs heads divisible by 2: a random-weight model with SmolLM2's widths but 8 heads
        tiny = save_tiny_model(Path(tmp) / "m", "llama", heads=8, kv_heads=4, layers=8, hidden=512,
                               intermediate=1536)
        thead = save_copy_eagle_head(Path(tmp) / "h", load_model_config(resolve_model(str(tiny))))
        spec2 = SpecConfig("EAGLE", str(thead), num_steps=args.steps, eagle_topk=1, num_draft_tokens=args.steps + 1)
        r2 = engine_bench(EngineConfig(model_path=str(tiny), dtype="bfloat16", max_total_tokens=8192, tp_size=2,
                                       spec=spec2), [[5, 6, 7, 8] * 4, [9] * 12, [100, 200], [3, 4]], args.max_tokens)
    print("\nper verify step (medians):")
    for name, r in (("tp=1 SmolLM2 + head", r1), ("tp=2 random 8-head llama", r2)):
        print(f"  {name:26s} accept length {r['accept_length']:.2f}  draft {r['draft_ms']:.1f} ms  verify "
              f"{r['verify_ms']:.1f} ms  verify-decision sync {r['verify_sync_ms']:.3f} ms  draft-decision sync "
              f"{r['draft_sync_ms']:.3f} ms  plan broadcast {r['control_sync_ms']:.3f} ms")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
