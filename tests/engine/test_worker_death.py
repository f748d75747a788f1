"""A worker that dies makes the engine fail fast with a clear error, never hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.engine import Engine, EngineDeadError
from worker.config import EngineConfig
from worker.sampling.params import SamplingParams


@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_worker_fails_pending_requests_within_seconds(tiny_llama, victim):
    eng = Engine(
        EngineConfig(model_path=str(tiny_llama), dtype="float32", tp_size=2, max_total_tokens=4096, dist_timeout=30)
    )
    try:
        errors: list[BaseException] = []
        started = threading.Event()

        def run() -> None:
            started.set()
            try:
                eng.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=1900, temperature=0, ignore_eos=True))
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        started.wait()
        deadline = time.monotonic() + 60
        while eng.stats.values.get("steps", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for progress, not papering over a race
        assert eng.stats.values["steps"] >= 3
        # forked from the forkserver or spawned, each rank is named for ps, top and the tests
        assert [Path(f"/proc/{p}/comm").read_text().strip() for p in eng.worker_pids] == [
            "eaglegate-tp0",
            "eaglegate-tp1",
        ]
        killed_at = time.monotonic()
        os.kill(eng.worker_pids[victim], signal.SIGKILL)
        t.join(timeout=20)
        assert not t.is_alive(), "generate() hung after a worker was killed"
        assert time.monotonic() - killed_at < 20
        assert errors and isinstance(errors[0], EngineDeadError)
        assert "exited" in str(errors[0]) or "rank" in str(errors[0])
        assert eng.dead_reason is not None
        with pytest.raises(EngineDeadError):
            eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    finally:
        eng.shutdown()


OWNER = """
import sys, time
from runtime.engine import Engine
from worker.config import EngineConfig
if __name__ == "__main__":
    eng = Engine(EngineConfig(model_path=sys.argv[1], dtype="float32", tp_size=2, max_total_tokens=1024))
    print(*eng.worker_pids, flush=True)
    time.sleep(600)
"""


def test_ranks_die_with_the_process_that_started_them(tiny_llama, tmp_path):
    """The engine's owner killed outright (no shutdown, no cleanup) leaves no rank behind: ranks forked from the
    forkserver die with it, as spawned ones die with their parent."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(tiny_llama)], stdout=subprocess.PIPE, text=True)
    try:
        ranks = [int(p) for p in owner.stdout.readline().split()]
        assert len(ranks) == 2 and all(Path(f"/proc/{p}").exists() for p in ranks)
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(Path(f"/proc/{p}").exists() for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if Path(f"/proc/{p}").exists()], "ranks outlived their engine's process"
    finally:
        owner.kill()
