"""Prefix caching through the real serving path: a server with the cache and one with `--disable-radix-cache`,
the same client load on each (official async `openai` client, streaming).

    .venv/bin/python bench/prefix.py [--users 8] [--conversations 16] [--turns 3] [--system-requests 32]
                                     [--machine M]   (make bench-prefix)

1. Multi-turn chat: ShareGPT conversations with at least three user turns; each of `--users` concurrent users
   plays conversations turn by turn, resending the whole history (with the model's own answers) each turn.
   Time to first token by turn, and output tokens per second.
2. A shared 1,500-token system prompt: `--system-requests` distinct questions behind it, 8 at a time.
Figures go to bench/results/prefix[-MACHINE].json with the command and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai

from devtools.provenance import add_machine_option, provenance, result_path
from training.data import sharegpt_conversations

MODEL = "smollm2-135m-instruct"


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("w", prefix="eaglegate-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        time.sleep(0.5)  # waiting for start-up, bounded by the deadline
    raise RuntimeError(f"server not healthy in 300 s; see {log.name}")


async def one_request(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    details = usage.prompt_tokens_details
    return {
        "ttft": (first or time.perf_counter()) - t0,
        "text": text,
        "output_tokens": usage.completion_tokens,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": details.cached_tokens if details else 0,
    }


def conversations(n: int, turns: int) -> list[list[str]]:
    """User turns (cut to 400 characters) of ShareGPT conversations with at least `turns` of them."""
    out = []
    for conv in sharegpt_conversations(4000, seed=7):
        users = [m["content"][:400] for m in conv if m["role"] == "user"]
        if len(users) >= turns:
            out.append(users[:turns])
        if len(out) == n:
            return out
    return out


async def multi_turn(port: int, convs: list[list[str]], users: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
    queue: asyncio.Queue = asyncio.Queue()
    for c in convs:
        queue.put_nowait(c)
    records: list[dict] = []

    async def user() -> None:
        while not queue.empty():
            turns = queue.get_nowait()
            history: list[dict] = []
            for i, text in enumerate(turns):
                history.append({"role": "user", "content": text})
                r = await one_request(client, history, max_tokens)
                history.append({"role": "assistant", "content": r["text"]})
                records.append(r | {"turn": i + 1})

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(users)))
    wall = time.perf_counter() - t0
    return summarize(records, wall) | {
        "by_turn": {
            str(t): summarize([r for r in records if r["turn"] == t], None)
            for t in sorted({r["turn"] for r in records})
        }
    }


async def shared_system(port: int, n: int, concurrency: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
    rules = " ".join(
        f"Rule {i}: answer questions about topic {i} politely and with one concrete example." for i in range(110)
    )  # about 1,500 tokens
    gate = asyncio.Semaphore(concurrency)

    async def ask(i: int) -> dict:
        async with gate:
            question = f"Question {i}: what is rule {i * 3 % 110}?"
            return await one_request(
                client, [{"role": "system", "content": rules}, {"role": "user", "content": question}], max_tokens
            )

    t0 = time.perf_counter()
    records = await asyncio.gather(*(ask(i) for i in range(n)))
    return summarize(list(records), time.perf_counter() - t0)


def summarize(records: list[dict], wall: float | None) -> dict:
    ttft = sorted(r["ttft"] for r in records)
    out = {
        "requests": len(records),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "ttft_p95_s": round(ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))], 3),
        "prompt_tokens": sum(r["prompt_tokens"] for r in records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
    }
    if wall is not None:
        out |= {"wall_s": round(wall, 1), "output_tok_s": round(sum(r["output_tokens"] for r in records) / wall, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-requests", type=int, default=32)
    ap.add_argument("--port", type=int, default=30310)
    add_machine_option(ap)
    args = ap.parse_args()
    convs = conversations(args.conversations, args.turns)
    results: dict = provenance() | {"settings": vars(args), "runs": {}}
    for name, extra in (("cache", []), ("no cache", ["--disable-radix-cache"])):
        proc = start_server(args.port, extra)
        try:
            run = {
                "multi_turn": asyncio.run(multi_turn(args.port, convs, args.users, args.max_tokens)),
                "shared_system_prompt": asyncio.run(shared_system(args.port, args.system_requests, 8, 32)),
            }
            run["engine_stats"] = {
                k: v
                for k, v in httpx.get(f"http://127.0.0.1:{args.port}/engine/stats").json().items()
                if k.startswith("prefix_cache")
            }
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        results["runs"][name] = run
        print(name, json.dumps(run, indent=1), flush=True)
    c, n = results["runs"]["cache"], results["runs"]["no cache"]
    later = [t for t in c["multi_turn"]["by_turn"] if t != "1"]
    results["ratios"] = {
        "turn_ge2_ttft_p50_speedup": round(
            statistics.mean(n["multi_turn"]["by_turn"][t]["ttft_p50_s"] for t in later)
            / statistics.mean(c["multi_turn"]["by_turn"][t]["ttft_p50_s"] for t in later),
            2,
        ),
        "multi_turn_throughput_ratio": round(c["multi_turn"]["output_tok_s"] / n["multi_turn"]["output_tok_s"], 2),
        "system_prompt_ttft_p50_speedup": round(
            n["shared_system_prompt"]["ttft_p50_s"] / c["shared_system_prompt"]["ttft_p50_s"], 2
        ),
        "system_prompt_throughput_ratio": round(
            c["shared_system_prompt"]["output_tok_s"] / n["shared_system_prompt"]["output_tok_s"], 2
        ),
    }
    print(json.dumps(results["ratios"], indent=1))
    result_path("prefix", args.machine).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
