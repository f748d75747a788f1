"""How far each CPU kernel's logits sit from the float32 reference, beside llama.cpp's on the same GGUF: every
position of MT-bench first turns (chat template applied), the same token ids for all.

    .venv/bin/python bench/accuracy.py [--limit 16] [--machine M]

The reference is transformers' float32 load of the GGUF (dequantized weights, float32 activations). Per prompt, the
error is max |logit - reference| / max |reference| (what tests/kernels/test_quantization.py bounds); over every
position, that error's median, the mean KL divergence from the reference's distribution (llama-perplexity's
measure), and the top-1 agreement: the share of positions whose argmax is the reference's. llama.cpp's logits come
from llama-cpp-python (`logits_all`, `make llama-cpp`), whose CPU backend multiplies the Q4_1 weights by Q8_1
activations. Writes bench/results/accuracy[-MACHINE].json with the command and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from spec import chat_prompt, mtbench_first_turns

from devtools.provenance import add_machine_option, provenance, result_path
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.kernels import cpu_choice
from worker.model.files import GGUF_NAME, fetch_default_model, resolve_model
from worker.protocol import ForwardPlan
from worker.runner import ModelRunner


def eaglegate_logits(kernel: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    cpu_choice.select(kernel)  # the weights are packed for it as the runner loads
    # each kernel's served numerics (int8act: float32 activations, bfloat16 KV); portable in bfloat16
    dtype = "bfloat16" if kernel == "portable" else "auto"
    cfg = EngineConfig(dtype=dtype, quantization="auto", cpu_kernel=kernel, max_total_tokens=4096)
    runner = ModelRunner(cfg, resolve_model(cfg.model_path), single_rank_group(torch.device("cpu")))
    out = []
    for ids in prompts:
        n = len(ids)
        plan = ForwardPlan(1, ids, [(0, n, list(range(runner.num_blocks)))], list(range(n)))
        out.append(runner.forward(plan)[0].float())
    return out


def llama_cpp_logits(prompts: list[list[int]]) -> list[torch.Tensor] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    path = fetch_default_model(quiet=True) / GGUF_NAME
    llm = Llama(model_path=str(path), n_threads=2, n_ctx=2048, logits_all=True, verbose=False)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        out.append(torch.from_numpy(llm.scores[: len(ids)].copy()).float())
    return out


def compare(logits: list[torch.Tensor], refs: list[torch.Tensor]) -> dict:
    errors = [float((a - r).abs().max() / r.abs().max()) for a, r in zip(logits, refs)]
    positions = torch.cat([(a - r).abs().amax(-1) / r.abs().amax() for a, r in zip(logits, refs)])
    kl = torch.cat([(r.softmax(-1) * (r.log_softmax(-1) - a.log_softmax(-1))).sum(-1) for a, r in zip(logits, refs)])
    agree = torch.cat([(a.argmax(-1) == r.argmax(-1)).float() for a, r in zip(logits, refs)])
    return {
        "max_rel_error_median": statistics.median(errors),
        "max_rel_error_max": max(errors),
        "position_rel_error_median": float(positions.median()),
        "kl_divergence_mean": float(kl.mean()),  # KL(reference || this), what llama-perplexity reports
        "top1_agreement": float(agree.mean()),
        "per_prompt": [round(e, 5) for e in errors],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=16)
    add_machine_option(ap)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = fetch_default_model(quiet=True)
    tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_NAME)
    prompts = [chat_prompt(tok, q) for q in mtbench_first_turns(args.limit)]
    ref_model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    with torch.no_grad():
        refs = [ref_model(torch.tensor([ids])).logits[0].float() for ids in prompts]
    del ref_model
    results: dict = {"prompts": len(prompts), "positions": sum(map(len, prompts)), "kernels": {}}
    for kernel in ["portable", *cpu_choice.built()]:
        with torch.inference_mode():
            results["kernels"][str(cpu_choice.resolve(kernel))] = compare(eaglegate_logits(kernel, prompts), refs)
    lc = llama_cpp_logits(prompts)
    results["llama.cpp"] = compare(lc, refs) if lc is not None else None
    results |= provenance()
    path = result_path("accuracy", args.machine)
    path.write_text(json.dumps(results, indent=2))
    for name, r in [*results["kernels"].items(), ("llama.cpp", results["llama.cpp"])]:
        if r:
            print(f"{name}: KL {r['kl_divergence_mean']:.5f}, per-position error median "
                  f"{r['position_rel_error_median']:.4f}, max {r['max_rel_error_max']:.4f}, "
                  f"top-1 agreement {r['top1_agreement']:.3f}")  # fmt: skip
    print(f"results in {path}")


if __name__ == "__main__":
    main()
