"""Start-up agreement: two nodes that would serve different things both refuse to start, and say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from devtools.models import save_random_eagle_head, save_tiny_model
from runtime.agreement import compare
from worker.dist import free_port
from worker.model.config import load_model_config
from worker.model.files import resolve_model

NODE_TIMEOUT = 60


class Node:
    def __init__(self, rank: int, addr: str, args: list[str]):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"eaglegate-node{rank}-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "server",
            "serve",
            "--tp-size",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            addr,
            "--port",
            str(self.port),
            "--dist-timeout",
            "30",
            *args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        return open(self.log.name).read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def _pair(common: list[str], node1_extra: list[str]) -> tuple[Node, Node]:
    addr = f"127.0.0.1:{free_port()}"
    return Node(0, addr, common), Node(1, addr, common + node1_extra)


@pytest.fixture(scope="module")
def variants(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    other_weights = save_tiny_model(root / "other-weights", "llama", heads=8, kv_heads=4, seed=1)
    cfg = load_model_config(resolve_model(str(tiny_llama)))
    heads = [save_random_eagle_head(root / f"head{i}", cfg, "eagle", seed=i) for i in range(2)]
    tok = root / "tokenizer"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_llama / name).exists():
            (tok / name).write_bytes((tiny_llama / name).read_bytes())
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    return {"weights": other_weights, "heads": heads, "tokenizer": tok}


def test_compare_names_each_difference_and_the_nodes():
    a = {"dtype": "bfloat16", "weights": "aa", "tp_size": "2"}
    b = {"dtype": "float32", "weights": "aa", "tp_size": "2"}
    assert compare([a, dict(a)], [0, 1]) is None
    msg = compare([a, b, dict(b)], [0, 1, 1])
    assert "dtype differs: node 0 (rank 0): bfloat16; node 1 (ranks 1, 2): float32" in msg
    assert "weights" not in msg


# Each pair of nodes differs in some fields and agrees on the rest: both nodes refuse, naming every field that
# differs and no field that agrees (one agreement covers every field, so a pair tests several at once).
FIELDS = ("dtype differs", "quantization differs", "weights differs", "draft head differs", "tokenizer differs")
CASES = {
    "dtype, head, tokenizer": (
        ["--dtype", "bfloat16", "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "{head0}"],
        ["--dtype", "float32", "--speculative-draft-model-path", "{head1}", "--tokenizer-path", "{tokenizer}"],
        ("dtype differs", "draft head differs", "tokenizer differs"),
    ),
    "quantization, weights": (
        ["--dtype", "bfloat16", "--quantization", "int4"],
        ["--quantization", "none", "--model-path", "{weights}"],
        ("quantization differs", "weights differs"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_nodes_both_refuse_to_start(tiny_llama, variants, case):
    node0_args, node1_args, expected = CASES[case]
    fill = {
        "weights": variants["weights"],
        "head0": variants["heads"][0],
        "head1": variants["heads"][1],
        "tokenizer": variants["tokenizer"],
    }
    common = ["--model-path", str(tiny_llama), "--max-total-tokens", "2048", *[a.format(**fill) for a in node0_args]]
    if "--speculative-algorithm" not in common:
        common += ["--speculative-algorithm", "NONE"]
    nodes = _pair(common, [a.format(**fill) for a in node1_args])  # later flags win on node 1
    try:
        deadline = time.monotonic() + NODE_TIMEOUT
        for n in nodes:
            n.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for n in nodes:
            n.kill()
    out0, out1 = nodes[0].output(), nodes[1].output()
    assert nodes[0].proc.returncode != 0 and nodes[1].proc.returncode != 0, out0 + out1
    for out in (out0, out1):
        assert all(e in out for e in expected), out
        assert "node 0 (rank 0)" in out and "node 1 (rank 1)" in out
    assert "listening on" not in out0
    assert not any(f in out0 for f in FIELDS if f not in expected), out0


def test_agreeing_nodes_serve_and_stop_together(tiny_llama):
    common = [
        "--model-path",
        str(tiny_llama),
        "--max-total-tokens",
        "2048",
        "--dtype",
        "float32",
        "--speculative-algorithm",
        "NONE",
    ]
    node0, node1 = _pair(common, [])
    try:
        deadline = time.monotonic() + NODE_TIMEOUT
        while time.monotonic() < deadline:
            assert node0.proc.poll() is None and node1.proc.poll() is None, node0.output() + node1.output()
            try:
                if httpx.get(f"http://127.0.0.1:{node0.port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # polling start-up, bounded by the deadline
        r = httpx.post(
            f"http://127.0.0.1:{node0.port}/v1/completions",
            json={"model": str(tiny_llama), "prompt": "hello", "max_tokens": 4, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        node0.proc.send_signal(15)
        assert node0.proc.wait(timeout=30) == 0, node0.output()
        assert node1.proc.wait(timeout=30) == 0, node1.output()
    finally:
        node0.kill()
        node1.kill()
