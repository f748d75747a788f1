"""Admission control: past the queue limits a request gets a 429 with Retry-After before it reaches rank 0, never a
5xx; after a burst the server serves normally and its KV is free."""

from __future__ import annotations

import asyncio

import httpx
import openai

from devtools.server import ServerProcess

BURST = 300


def test_a_burst_past_the_queue_limit_gets_429s_and_the_server_recovers(tiny_llama):
    server = ServerProcess(
        ["--model-path", str(tiny_llama), "--served-model-name", "tiny", "--dtype", "float32",
         "--max-total-tokens", "4096", "--speculative-algorithm", "NONE",
         "--max-running-requests", "2", "--max-queued-requests", "6"]
    )  # fmt: skip
    try:
        statuses, retry_after = asyncio.run(_burst(server.base_url))
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        assert statuses.count(429) > BURST // 2 and statuses.count(200) >= 8
        assert retry_after == {"1"}
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text  # each refusal counted, by status
        line = next(
            x for x in metrics.splitlines() if x.startswith("eaglegate_requests_rejected_total") and '"429"' in x
        )
        assert float(line.rsplit(" ", 1)[1]) == statuses.count(429)
        stats = server.stats()
        assert stats["kv_used_tokens"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        assert server.stop() == 0


async def _burst(base_url: str) -> tuple[list[int], set[str]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i: int) -> tuple[int, str | None]:
        try:
            r = await client.completions.with_raw_response.create(model="tiny", prompt=f"count {i}", max_tokens=16)
            return r.status_code, None
        except openai.APIStatusError as e:
            return e.status_code, e.response.headers.get("retry-after")

    results = await asyncio.gather(*(one(i) for i in range(BURST)))
    await client.close()
    return [s for s, _ in results], {h for s, h in results if s == 429}
