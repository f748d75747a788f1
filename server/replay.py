"""`eaglegate replay DUMP`: where did the ranks of a failed worker group part?

DUMP is a folder of `rank{r}.json` files that each rank wrote when it failed (`--crash-dump-folder`,
worker/forensics.py): its last steps' plans, committed state and fingerprints. Replay first recomputes every
record's fingerprint from its fields with the guard's own function (a record that does not reproduce its digest is
reported: the dump cannot be trusted), then walks the steps all ranks recorded, oldest first, and names the first
field whose value differs between ranks, with each rank's value:

    step 41, sequence 0: accepted differs: rank 0 = 2, rank 1 = 3, rank 2 = 2

Fields, in the order they are compared: the plan (a forward step's context and query lengths and input tokens; a
speculative step's draft flag, context length, draft cache, catch-up length and context candidates), then what each
rank committed (a forward step's `seq_len`; a speculative step's `seq_len`, `accepted`, `bonus`, `path`), then the
decision channel (`decisions`: its digest and count)."""

from __future__ import annotations

import json
from pathlib import Path

from worker.guard import fingerprint
from worker.protocol import ForwardPlan, SpecPlan, SpecSeq


def load(folder: Path) -> dict[int, dict]:
    dumps = {}
    for path in sorted(folder.glob("rank*.json")):
        body = json.loads(path.read_text())
        dumps[body["rank"]] = body
    if not dumps:
        raise SystemExit(f"eaglegate replay: no rank*.json in {folder}")
    return dumps


def rebuild(record: dict) -> ForwardPlan | SpecPlan:
    """The plan as the guard saw it (block tables and sample rows do not enter the fingerprint)."""
    p = record["plan"]
    if p["kind"] == "forward":
        return ForwardPlan(record["step"], p["input_ids"], [(ctx, q, []) for ctx, q in p["seqs"]], [])
    seqs = [SpecSeq(q["ctx_len"], [], q["draft_cached"], [0] * q["extend"], q["context_ids"]) for q in p["seqs"]]
    return SpecPlan(record["step"], seqs, p["draft"])


def fields(record: dict) -> list[tuple[str, object]]:
    """(name, value) of a record in comparison order."""
    p, committed = record["plan"], record["committed"]
    out: list[tuple[str, object]] = [("step kind", p["kind"])]
    if p["kind"] == "forward":
        out.append(("batch size", len(p["seqs"])))
        for i, (ctx, q) in enumerate(p["seqs"]):
            out += [(f"sequence {i}: context length", ctx), (f"sequence {i}: query length", q)]
        out.append(("input tokens", p["input_ids"]))
        out += [(f"sequence {i}: seq_len", n) for i, n in enumerate(committed)]
        return out
    out += [("draft", p["draft"]), ("batch size", len(p["seqs"]))]
    for i, q in enumerate(p["seqs"]):
        out += [(f"sequence {i}: {k}", q[k]) for k in ("ctx_len", "draft_cached", "extend", "context_ids")]
    at = 0
    for i, q in enumerate(p["seqs"]):  # per sequence [seq_len, bonus, *path], as speculative/leader.py commits
        seq_len, bonus = committed[at], committed[at + 1]
        accepted = seq_len - q["ctx_len"] - 1
        path = committed[at + 2 : at + 2 + max(accepted, 0)]
        out += [(f"sequence {i}: seq_len", seq_len), (f"sequence {i}: accepted", accepted)]
        out += [(f"sequence {i}: bonus", bonus), (f"sequence {i}: path", path)]
        at += 2 + max(accepted, 0)
    out.append(("decisions", committed[at:]))
    return out


def report(dumps: dict[int, dict]) -> list[str]:
    lines = []
    for rank, body in sorted(dumps.items()):
        bad = [r["step"] for r in body["records"] if fingerprint(rebuild(r), r["committed"]) != r["fingerprint"]]
        steps = [r["step"] for r in body["records"]]
        span = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        lines.append(f"rank {rank}: {span}, failed with {body['error']}")
        if bad:
            lines.append(f"rank {rank}: records of steps {bad} do not reproduce their fingerprints")
    by_step = [{r["step"]: r for r in body["records"]} for _, body in sorted(dumps.items())]
    ranks = sorted(dumps)
    common = sorted(set.intersection(*(set(s) for s in by_step)))
    for step in common:
        per_rank = [dict(fields(s[step])) for s in by_step]
        names = [name for name, _ in fields(by_step[0][step])]
        for name in names:
            values = [f.get(name, "(absent)") for f in per_rank]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r} = {v}" for r, v in zip(ranks, values))
                lines.append(f"first divergence: step {step}, {name} differs: {shown}")
                return lines
    last = {r: body["records"][-1]["step"] if body["records"] else None for r, body in dumps.items()}
    if len(set(last.values())) > 1:
        shown = ", ".join(f"rank {r} = {s}" for r, s in sorted(last.items()))
        lines.append(f"first divergence: the ranks stopped at different steps: {shown}")
    else:
        lines.append("no divergence in the recorded steps: the ranks agree on every field")
    return lines


def main(folder: str) -> int:
    for line in report(load(Path(folder))):
        print(line)
    return 0
