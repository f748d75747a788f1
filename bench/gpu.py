"""GPU throughput: tokens/s eager against captured graphs, plain and with EAGLE, at concurrency 1, 16 and 64.

    python bench/gpu.py [--machine h100] [--out PATH] [--moe-layers 4]   (scripts/gpu-check.sh runs it)

Writes bench/results/gpu[-MACHINE].json, or PATH. Four targets:
- **SmolLM2-135M's shape with random weights**, built by this script with transformers (30 layers, hidden 576, 9 heads,
  3 KV heads, tied 49,152-token vocabulary). Plain decoding costs the same whatever the weights, so this measures
  the step on a host that has only the tokenizer, not the 98 MB GGUF. Its EAGLE run (the shipped head, which accepts
  nothing on random weights) measures what verify trees cost on the GPU: the calibrated cost by rows, eager and
  captured.
- **The real SmolLM2-135M-Instruct GGUF** with the shipped EAGLE-3 head, when it is present (EAGLEGATE_HOME):
  plain and EAGLE tok/s on MT-bench first turns (or built-in prompts), and how many outputs are identical.
- **Qwen3-MoE's and GLM-4.7-Flash's shapes** with random weights and --moe-layers layers (devtools/shaped_models.py):
  the fused MoE and, for GLM, the latent-attention kernel, eager against captured; Qwen3-MoE plain and with a random
  EAGLE head (verify cost), GLM plain and drafting with its MTP layer; at tp=2 as well when the host has two GPUs.
Every request generates exactly --max-tokens tokens on the random models (ignore_eos); the real model stops at EOS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from devtools.provenance import add_machine_option, provenance, result_path  # noqa: E402
from devtools.shaped_models import glm_flash_shaped, qwen3_moe_shaped  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from speculative.defaults import default_spec_config  # noqa: E402
from training.train_data import chat_ids  # noqa: E402
from worker.config import EngineConfig, SpecConfig  # noqa: E402
from worker.model.files import GGUF_NAME, default_model_dir, eaglegate_home  # noqa: E402
from worker.sampling.params import SamplingParams  # noqa: E402

PROMPTS = [
    "Explain how a hash map works.",
    "Write a short poem about the sea.",
    "What causes the seasons?",
    "List five uses of Python.",
    "Summarise the plot of Hamlet.",
    "How do vaccines work?",
    "Give three tips for a job interview.",
    "Describe the water cycle.",
]
# on a GPU a verify row costs far less than a step, so deeper trees than the CPU default (s1 k1 n2) can pay
GPU_TREE = {
    "num_steps": 4,
    "eagle_topk": 2,
    "num_draft_tokens": 8,
    "disable_batch_size": 0,
    "calibrate_batch_limit": False,
}


def smol_shaped_model(folder: Path) -> Path:
    """A random-weight Llama with SmolLM2-135M's exact shape and its tokenizer."""
    import transformers

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    for f in (default_model_dir() / "tokenizer").iterdir():  # first: config.json, written last, marks a whole folder
        (folder / f.name).write_bytes(f.read_bytes())
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def throughput(engine: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    batch = (prompts * (concurrency // len(prompts) + 1))[:concurrency]
    engine.generate(batch[:1], dataclasses.replace(params, max_new_tokens=4))  # warm the path
    t0 = time.perf_counter()
    out = engine.generate(batch, params)
    secs = time.perf_counter() - t0
    return {"tok_s": sum(len(r.token_ids) for r in out) / secs, "seconds": secs, "outputs": [r.token_ids for r in out]}


def run_target(
    model_path: str,
    prompts_of,
    concurrencies: list[int],
    params: SamplingParams,
    specs: dict[str, SpecConfig],
    tp: int = 1,
) -> dict:
    results: dict = {}
    for eager in (True, False):
        mode = "eager" if eager else "captured"
        for name, spec in {"plain": SpecConfig(), **specs}.items():
            cfg = EngineConfig(
                model_path=model_path,
                dtype="bfloat16",
                enforce_eager=eager,
                spec=spec,
                max_total_tokens=65536,
                tp_size=tp,
            )
            t0 = time.perf_counter()
            with Engine(cfg) as eng:
                start = time.perf_counter() - t0
                prompts = prompts_of(eng.tokenizer)
                row = {"startup_s": start}
                for c in concurrencies:
                    r = throughput(eng, prompts, c, params)
                    row[str(c)] = {"tok_s": r["tok_s"], "seconds": r["seconds"]}
                    row.setdefault("_outputs", {})[str(c)] = r["outputs"]
                snap = eng.stats.snapshot
                row["graph_replays"] = snap.graph_replays
                if snap.spec is not None:
                    row["tau"] = snap.spec.accept_length_mean
                    row["verify_cost_ms"] = snap.spec_verify_cost_ms
            results.setdefault(mode, {})[name] = row
            print(mode, name, {k: v for k, v in row.items() if k != "_outputs"}, flush=True)
    for mode in results.values():  # outputs identical to plain greedy, then drop the token lists
        plain = mode["plain"].pop("_outputs")
        for name, row in mode.items():
            if name != "plain":
                outs = row.pop("_outputs")
                row["identical"] = {c: sum(a == b for a, b in zip(outs[c], plain[c])) for c in outs}
    return results


def run_moe_shaped(out: dict, work: Path, layers: int, ids, conc: list[int], fixed: SamplingParams, save) -> None:
    """Qwen3-MoE and GLM-4.7-Flash shapes, each plain and with its draft, at tp=1 (and tp=2 on two GPUs)."""
    from devtools.models import save_random_eagle_head
    from worker.model.config import load_model_config
    from worker.model.files import resolve_model

    qwen = qwen3_moe_shaped(work / f"qwen3-moe-shaped-{layers}", layers)
    head = save_random_eagle_head(work / "qwen3-moe-head", load_model_config(resolve_model(str(qwen))))
    glm = glm_flash_shaped(work / f"glm-flash-shaped-{layers}", layers)
    targets = {
        "qwen3_moe_shaped": (qwen, {"eagle": SpecConfig("EAGLE", str(head), 3, 2, 6, cost_table="off")}),
        "glm_flash_shaped": (glm, {"mtp": SpecConfig("EAGLE", None, 3, 1, 4, cost_table="off")}),
    }
    vocab_ids = [[t % 49000 for t in p] for p in ids]
    for tp in (1, 2) if torch.cuda.device_count() >= 2 else (1,):
        for name, (folder, specs) in targets.items():
            key = name if tp == 1 else f"{name}_tp{tp}"
            out[key] = run_target(str(folder), lambda tok: vocab_ids, conc, fixed, specs, tp=tp) | {"layers": layers}
            save()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results file (default: bench/results/gpu[-MACHINE].json)")
    add_machine_option(p)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--work", default="/tmp/eaglegate-gpu-bench")
    p.add_argument("--moe-layers", type=int, default=4, help="layers of the MoE-shaped models (0: skip them)")
    args = p.parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    out: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "max_tokens": args.max_tokens,
        "concurrency": conc,
    }
    random_model = smol_shaped_model(Path(args.work) / "smol-shaped")
    ids = [[(97 * i + 13 * j) % 49000 + 100 for j in range(64)] for i in range(8)]  # 64-token synthetic prompts
    fixed = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    path = Path(args.out) if args.out else result_path("gpu", args.machine)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each target, so a failure later keeps what was measured
        path.write_text(json.dumps(out | provenance(), indent=1) + "\n")

    out["smol_shaped_random"] = run_target(
        str(random_model),
        lambda tok: ids,
        conc,
        fixed,
        {"eagle_gpu_tree": dataclasses.replace(default_spec_config(), **GPU_TREE)},
    )
    save()
    if args.moe_layers:
        run_moe_shaped(out, Path(args.work), args.moe_layers, ids, conc, fixed, save)
    if (default_model_dir() / GGUF_NAME).exists():
        questions = PROMPTS
        mt = eaglegate_home() / "data" / "mt_bench_question.jsonl"
        if mt.exists():
            questions = [json.loads(line)["turns"][0] for line in mt.read_text().splitlines() if line.strip()][:16]

        def chat(tok):
            return [chat_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]

        specs = {
            "eagle_default": default_spec_config(),
            "eagle_gpu_tree": dataclasses.replace(default_spec_config(), **GPU_TREE),
        }
        out["smollm2_135m_instruct"] = run_target(
            "smollm2-135m-instruct", chat, conc, SamplingParams(max_new_tokens=args.max_tokens, temperature=0), specs
        )
    else:
        out["smollm2_135m_instruct"] = f"not measured: {GGUF_NAME} is not under {default_model_dir()}"
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
