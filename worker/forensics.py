"""Rank forensics: what each rank last did, readable while it runs and kept when it fails.

- **Heartbeat**: a small memory-mapped file per rank of node 0 (in the engine's run folder) holding the last step
  the rank completed, when, its state fingerprint, and the collective it is in or last left. Writing is a few memory
  stores per collective, so it is always on; the front end reads every rank's file for `/debug/ranks`, and keeps
  the last ones of a failed group.
- **Flight recorder**: the last RECORD_STEPS steps' plans, committed state and fingerprints on every rank. When a
  rank fails (the divergence guard, a collective timeout, any error), or the engine signals a rank still alive in a
  failed group, it writes them to `--crash-dump-folder`, one file per rank in a folder per worker group.
  `eaglegate replay DUMP` (server/replay.py) recomputes each rank's fingerprints from the records and names the
  first step and field where the ranks parted.
- The heartbeat sees host-side collectives: a GPU collective returns once it is queued (and inside a captured
  graph runs no Python at all), so on GPUs it shows the last control-group collective, where a hang surfaces.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import threading
import time
from collections import deque
from pathlib import Path

from worker.protocol import ForwardPlan, SpecPlan, StepPlan

RECORD_STEPS = 32
LAYOUT = struct.Struct("<qdqB23s")  # step, wall time of that step, fingerprint, in a collective, collective name
NAME_BYTES = 23


class Heartbeat:
    """One rank's heartbeat file: written by the rank, read by the front end."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "wb") as f:
            f.write(b"\0" * LAYOUT.size)
        self._f = open(path, "r+b")  # noqa: SIM115 - kept open for the mapping's life
        self._mm = mmap.mmap(self._f.fileno(), LAYOUT.size)
        self.step, self.time, self.fingerprint, self.collective = -1, 0.0, 0, ""

    def _write(self, inside: bool) -> None:
        name = self.collective.encode()[:NAME_BYTES]
        self._mm[: LAYOUT.size] = LAYOUT.pack(self.step, self.time, self.fingerprint, inside, name)

    def enter(self, collective: str) -> None:
        self.collective = collective
        self._write(True)

    def leave(self) -> None:
        self._write(False)

    def step_done(self, step: int, fingerprint: int) -> None:
        self.step, self.time, self.fingerprint = step, time.time(), fingerprint
        self._write(False)


def read_heartbeat(path: Path) -> dict | None:
    try:
        raw = path.read_bytes()[: LAYOUT.size]
    except OSError:
        return None
    if len(raw) < LAYOUT.size:
        return None
    step, when, digest, inside, name = LAYOUT.unpack(raw)
    return {
        "last_step": step,
        "last_step_age_s": round(time.time() - when, 3) if when else None,
        "fingerprint": f"{digest & 0xFFFFFFFFFFFFFFFF:016x}",
        "collective": name.rstrip(b"\0").decode(),
        "in_collective": bool(inside),
    }


def heartbeat_path(folder: Path, rank: int) -> Path:
    return folder / f"heartbeat-rank{rank}"


def read_heartbeats(folder: Path, ranks: int) -> list[dict | None]:
    return [read_heartbeat(heartbeat_path(folder, r)) for r in range(ranks)]


def plan_record(plan: StepPlan) -> dict:
    """The fields of a plan the fingerprint covers, as JSON."""
    if isinstance(plan, ForwardPlan):
        return {"kind": "forward", "seqs": [[ctx, q] for ctx, q, _ in plan.seqs], "input_ids": plan.input_ids}
    if isinstance(plan, SpecPlan):
        seqs = [
            {
                "ctx_len": q.ctx_len,
                "draft_cached": q.draft_cached,
                "extend": len(q.extend_ids),
                "context_ids": q.context_ids,
            }
            for q in plan.seqs
        ]
        return {"kind": "spec", "draft": bool(plan.draft), "seqs": seqs}
    return {"kind": type(plan).__name__}


class FlightRecorder:
    def __init__(self, rank: int, size: int = RECORD_STEPS):
        self.rank = rank
        self.records: deque[dict] = deque(maxlen=size)

    def record(self, plan: StepPlan, committed: list[int], fingerprint: int) -> None:
        self.records.append(
            {
                "step": plan.step,
                "time": time.time(),
                "plan": plan_record(plan),
                "committed": list(committed),
                "fingerprint": fingerprint,
            }  # fmt: skip
        )

    def dump(self, folder: Path, group: str, tp_size: int, error: BaseException) -> Path:
        out = folder / f"group-{group}"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"rank{self.rank}.json"
        body = {
            "rank": self.rank,
            "tp_size": tp_size,
            "pid": os.getpid(),
            "error": f"{type(error).__name__}: {error}",
            "records": list(self.records),
        }
        path.write_text(json.dumps(body))
        return path


def dump_on_signal(dump) -> None:
    """Call `dump` when the process gets SIGUSR1, from a thread of its own: the main thread may be blocked inside a
    collective (which releases the GIL), where a Python signal handler would never run. The engine sends SIGUSR1 to
    the ranks still alive before it kills a failed group."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # every thread started later inherits the mask

    def wait() -> None:
        signal.sigwait({signal.SIGUSR1})
        dump()

    threading.Thread(target=wait, name="eaglegate-dump-on-signal", daemon=True).start()
