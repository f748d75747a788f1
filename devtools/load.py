"""Load against a running gateway: concurrent clients mixing streaming and not, greedy and sampled; a share of the
streaming clients hang up at random points. Prints requests/s, tokens/s, p50/p99 latency, and checks that
nothing leaked afterwards.

    .venv/bin/python -m devtools.load --url http://127.0.0.1:30000 [--clients 64] [--requests-per-client 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = [
    "Tell me about the history of tea.",
    "Write a limerick about a cat.",
    "How do airplanes fly?",
    "List some good habits for students.",
    "What is machine learning?",
    "Describe a rainy day in a city.",
    "Give me a recipe for pancakes.",
    "Why is the ocean salty?",
]


@dataclass
class LoadReport:
    completed: int = 0
    abandoned: int = 0
    failed: list = field(default_factory=list)  # (status, body) of every non-200
    latencies: list = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def percentile(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

    def summary(self) -> dict:
        return {
            "completed": self.completed,
            "abandoned": self.abandoned,
            "failed": len(self.failed),
            "requests_per_s": self.completed / self.seconds,
            "tokens_per_s": self.tokens / self.seconds,
            "p50_s": self.percentile(0.5),
            "p99_s": self.percentile(0.99),
        }


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rng: random.Random,
    report: LoadReport,
    max_tokens: int,
    hangup_share: float,
    headers: dict,
) -> None:
    try:
        await _request(client, url, model, rng, report, max_tokens, hangup_share, headers)
    except httpx.HTTPError as e:  # refused or cut connections count as failures (status 0), never crash the run
        report.failed.append((0, f"{type(e).__name__}: {e}"[:200]))


async def _request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rng: random.Random,
    report: LoadReport,
    max_tokens: int,
    hangup_share: float,
    headers: dict,
) -> None:
    stream = rng.random() < 0.5
    body = {
        "model": model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(max_tokens // 2, max_tokens),
        "stream": stream,
        "temperature": 0 if rng.random() < 0.5 else 0.8,
        "seed": rng.randint(0, 1000),
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    hang_after = rng.randint(1, 8) if stream and rng.random() < hangup_share else None
    t0 = time.perf_counter()
    if not stream:
        r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            report.failed.append((r.status_code, r.text[:200]))
            return
        report.tokens += r.json()["usage"]["completion_tokens"]
    else:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                report.failed.append((r.status_code, (await r.aread())[:200]))
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    report.failed.append((200, line[:200]))
                    return
                chunks += 1
                if hang_after is not None and chunks >= hang_after:
                    report.abandoned += 1
                    return  # leaving the context manager closes the connection mid-stream
                if data.get("usage"):
                    report.tokens += data["usage"]["completion_tokens"]
    report.completed += 1
    report.latencies.append(time.perf_counter() - t0)


async def run_load(
    url: str,
    model: str,
    clients: int = 64,
    requests_per_client: int = 3,
    max_tokens: int = 48,
    hangup_share: float = 1 / 3,
    seed: int = 0,
    api_key: str | None = None,
) -> LoadReport:
    report = LoadReport()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            for _ in range(requests_per_client):
                await _one(client, url, model, rng, report, max_tokens, hangup_share, headers)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        report.seconds = time.perf_counter() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    report = asyncio.run(
        run_load(args.url, args.model, args.clients, args.requests_per_client, args.max_tokens, api_key=args.api_key)
    )
    s = report.summary()
    print(json.dumps(s, indent=2))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stats = httpx.get(args.url + "/engine/stats", headers=headers).json()
    print(f"after: running {stats['running']}, waiting {stats['waiting']}, KV used {stats['kv_used_tokens']}")
    if report.failed:
        print("failures:", report.failed[:5])


if __name__ == "__main__":
    main()
