"""Continuous batching: outputs independent of batch composition; KV returned; small pools still finish."""

from __future__ import annotations

import random

import pytest

from runtime.engine import Engine, EngineBusyError, _Sink
from worker.config import EngineConfig
from worker.sampling.params import InvalidParameterError, SamplingParams


def _mixed_prompts(engine, n: int = 16) -> list[list[int]]:
    rng = random.Random(7)
    words = "the river mountain quiet engine spark garden ocean silver paper lantern music window".split()
    prompts = []
    for _ in range(n):
        length = rng.choice([3, 8, 20, 60, 150])
        prompts.append(engine.encode(" ".join(rng.choice(words) for _ in range(length))))
    return prompts


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=[4, 12, 20, 33][i % 4], temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mixed_batch(served_engine):
    """The mixed prompts, their parameters and the served engine's output for them generated together."""
    prompts = _mixed_prompts(served_engine, 12)
    params = [_params(i) for i in range(len(prompts))]
    return prompts, params, served_engine.generate(prompts, params)


def test_batch_equals_each_alone_and_frees_kv(served_engine, mixed_batch):
    prompts, params, together = mixed_batch
    alone = [served_engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [len(r.token_ids) for r in together] == [p.max_new_tokens for p in params]
    stats = served_engine.stats.values
    assert stats["kv_used_tokens"] == 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_pool_too_small_for_all_still_finishes(mixed_batch):
    prompts, params, ref = mixed_batch
    total = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
    # about a quarter of what all need at once, chunked prefill forcing several steps per long prompt
    cfg = EngineConfig(max_total_tokens=256, chunked_prefill_size=64, block_size=16)
    assert cfg.max_total_tokens < total / 2
    with Engine(cfg) as eng:
        out = eng.generate(prompts, params)
        assert [r.token_ids for r in out] == [r.token_ids for r in ref]
        assert eng.stats.values["num_preemptions"] > 0
        assert eng.stats.values["kv_used_tokens"] == 0


def test_seeded_sampling_reproducible_across_batches(served_engine):
    prompt = served_engine.encode("Write a poem about the sea:")
    sp = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = served_engine.generate([prompt], [sp])[0].token_ids
    others = _mixed_prompts(served_engine, 6)
    mixed = served_engine.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(max_new_tokens=10, temperature=1.0)] * 3
        + [sp]
        + [SamplingParams(max_new_tokens=5, temperature=0.7, seed=9)] * 3,
    )
    assert mixed[3].token_ids == alone
    other_seed = served_engine.generate([prompt], [SamplingParams(max_new_tokens=24, temperature=0.9, seed=99)])[0]
    assert other_seed.token_ids != alone


def test_sampling_controls(served_engine):
    prompt = served_engine.encode("List some fruits: apple, banana,")
    # top_k=1 is greedy whatever the temperature
    greedy = served_engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))[0]
    k1 = served_engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True)
    )[0]
    assert k1.token_ids == greedy.token_ids
    # a strong repetition penalty changes a greedy continuation that repeats tokens
    pen = served_engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, temperature=0, repetition_penalty=1.8, ignore_eos=True)
    )[0]
    assert pen.token_ids != greedy.token_ids
    # stop token ids end generation on that token
    stop_at = greedy.token_ids[5]
    stopping = SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop_at,))
    cut = served_engine.generate([prompt], stopping)[0]
    assert cut.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_at) + 1]
    assert cut.finish_reason == "stop"
    # logprobs: the chosen token's logprob plus top alternatives, greedy picks the top one
    lp = served_engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0, logprobs=3))[0]
    assert len(lp.logprobs) == 4
    for entry in lp.logprobs:
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id
        assert entry.logprob <= 0 and abs(entry.logprob - entry.top[0][1]) < 1e-5


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("temperature", -0.5, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -3, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("max_new_tokens", 0, "max_tokens"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("presence_penalty", 3.0, "presence_penalty"),
        ("frequency_penalty", float("inf"), "frequency_penalty"),
        ("seed", -1, "seed"),
        ("logprobs", 50, "top_logprobs"),
        ("stop_token_ids", (10**9,), "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_rejected(served_engine, field, value, param):
    with pytest.raises(InvalidParameterError) as err:
        served_engine.generate([[1, 2, 3]], SamplingParams(**{field: value}))
    assert err.value.param == param
    assert str(err.value)


def test_prompt_beyond_context_fails_cleanly(smol_dir):
    from runtime.engine import RequestFailedError

    with Engine(EngineConfig(dtype="float32", max_total_tokens=128)) as eng:
        with pytest.raises(RequestFailedError, match="context limit"):
            eng.generate([[5] * 200], SamplingParams(max_new_tokens=2))
        assert eng.generate([[5] * 10], SamplingParams(max_new_tokens=2))[0].finish_reason == "length"


def test_stats_snapshots_are_rate_limited_and_fresh_when_a_request_ends(smol_dir):
    """Rank 0 sends its stats snapshot with a step's report at most every SNAPSHOT_INTERVAL_S (a snapshot every step
    cost 2.5% of decode speed), but always with a finished request, so stats read after generate() are current."""
    from worker.leader import SNAPSHOT_INTERVAL_S

    reports = []
    # bfloat16: steps of a few ms (float32's eager steps take longer than the interval, so each would carry one)
    with Engine(EngineConfig(dtype="bfloat16", max_total_tokens=4096), on_step=reports.append) as eng:
        out = eng.generate(
            [eng.encode("Count from one to fifty in words.")],
            SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True),
        )[0]
        final = eng.stats.snapshot
    assert len(out.token_ids) == 40
    finished = [r for r in reports if any(o.finish_reason for o in r.outputs)]
    assert len(finished) == 1 and finished[0].stats is final and final.running == 0
    snaps = [r.stats for r in reports if r.stats is not None and r is not finished[0]]
    assert len(snaps) < sum(1 for r in reports if r.outputs) - 1  # steps inside the interval carry none
    assert all(b.time - a.time >= 0.9 * SNAPSHOT_INTERVAL_S for a, b in zip(snaps, snaps[1:]))


def test_a_batch_past_the_queue_limit_is_refused_whole(served_engine):
    """Admission counts every request of a batch (an `n`-choice request is n): one past the limit refuses them all,
    and none reaches rank 0."""
    max_requests, max_tokens = served_engine.queue_limits
    assert max_requests == 64 + 8 * 64 and max_tokens == 5 * served_engine.ready.kv_total_tokens  # the defaults
    reqs = [(f"busy-{i}", [1, 2, 3], SamplingParams(max_new_tokens=1)) for i in range(max_requests + 1)]
    with pytest.raises(EngineBusyError, match=f"the limit is {max_requests}"):
        served_engine.submit(reqs, [_Sink(lambda _: None) for _ in reqs])
    assert served_engine.num_in_flight == 0
    assert served_engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, temperature=0))[0].token_ids


def test_a_request_past_its_timeout_finishes_on_rank_0_and_frees_its_kv(served_engine):
    """SamplingParams.timeout_s (--request-timeout): rank 0 finishes the request with finish_reason "timeout",
    keeps what it generated, returns its KV; a request beside it without a timeout is unaffected."""
    import time

    prompt = served_engine.encode("Count from one to ten thousand:")
    endless = SamplingParams(max_new_tokens=6000, temperature=0, ignore_eos=True, timeout_s=1.0)
    short = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    timed, other = served_engine.generate([prompt, prompt], [endless, short])
    assert timed.finish_reason == "timeout" and 0 < len(timed.token_ids) < 6000
    assert 1.0 <= time.monotonic() - t0 < 10
    n = min(8, len(timed.token_ids))  # a slow machine may time it out within its first 8 tokens
    assert other.finish_reason == "length" and len(other.token_ids) == 8 and other.token_ids[:n] == timed.token_ids[:n]
    assert served_engine.stats.values["kv_used_tokens"] == 0
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        SamplingParams(timeout_s=0).validate()


def test_a_stalled_rank_0_never_blocks_a_submit(tiny_llama):
    """With rank 0 stopped (SIGSTOP) its inbox fills; a submit then fails at once with EngineInboxFullError (a 503 to
    clients) instead of waiting, and once rank 0 runs again every request that was accepted completes."""
    import os
    import signal
    import time

    from runtime.engine import EngineInboxFullError

    cfg = EngineConfig(model_path=str(tiny_llama), dtype="float32", max_total_tokens=4096, max_queued_requests=100000)
    one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
    with Engine(cfg) as eng:
        rank0 = eng.worker_pids[0]
        os.kill(rank0, signal.SIGSTOP)
        try:
            sinks, slowest, refused = [], 0.0, None
            for i in range(50000):
                q: list = []
                t0 = time.monotonic()
                try:
                    eng.submit([(f"r{i}", [5, 6], one)], [_Sink(q.append)])
                except EngineInboxFullError as e:
                    refused = e
                    break
                finally:
                    slowest = max(slowest, time.monotonic() - t0)
                sinks.append(q)
            assert refused is not None and "inbox is full" in str(refused) and slowest < 1.0
        finally:
            os.kill(rank0, signal.SIGCONT)
        deadline = time.monotonic() + 120
        while not all(any(getattr(o, "finish_reason", None) for o in q) for q in sinks):
            assert time.monotonic() < deadline, "accepted requests did not finish"
            time.sleep(0.1)
        assert eng.is_alive and eng.num_in_flight == 0
