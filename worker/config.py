"""Frozen engine configuration, passed down to every component instead of globals."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

DEFAULT_MODEL = "smollm2-135m-instruct"
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")  # worker/kernels/quant.py
TARGET_QUANTIZATION_CHOICES = QUANTIZATION_CHOICES + ("fp8",)  # fp8: a block-FP8 checkpoint's own bytes (GPUs)
CPU_KERNEL_CHOICES = ("auto", "bf16", "int8act", "portable")  # worker/kernels/cpu_choice.py
SPECULATIVE_ALGORITHMS = ("NONE", "EAGLE", "EAGLE3", "NEXTN", "MTP")


@dataclass(frozen=True)
class SpecConfig:
    """EAGLE speculative decoding settings (SGLang flag names)."""

    algorithm: str = "NONE"  # NONE | EAGLE | EAGLE3 | NEXTN | MTP (the last two: EAGLE's aliases, SGLang's names)
    # an EAGLE head; None: the target checkpoint's own multi-token-prediction layer (speculative/mtp.py)
    draft_model_path: str | None = None
    num_steps: int = 4
    eagle_topk: int = 1
    num_draft_tokens: int = 5
    accept_threshold_single: float = 1.0
    accept_threshold_acc: float = 1.0
    # decode batches of this many sequences or more run plain steps (0: never), where a wider verify costs more
    # than speculation saves (vLLM's disable_by_batch_size)
    disable_batch_size: int = 0
    # the shipped default's limit: rank 0 lowers it to the first batch size where its start-up timing finds a second
    # verify row per sequence costing more than half a step (speculative/worker.py: batch_limit); a limit the user
    # gives is kept as given
    calibrate_batch_limit: bool = False
    # prompt-lookup candidates joined to each verify tree (speculative/context.py); 0 turns them off
    context_tokens: int = 8
    context_ngram: int = 3
    # rank 0's per-step tree budget (speculative/budget.py): "auto" measures verify cost at start-up, a path
    # loads a JSON cost table, "off" verifies the full configured tree on every step
    cost_table: str = "auto"
    # the draft head's weights on CPU: auto is int8 beside a quantized target (speculative/worker.py), else dense
    draft_quantization: str = "auto"  # auto | none | int8 | int4
    # corpus candidates (speculative/corpus.py): "auto" is the target's own distilled answers where the target is
    # the default model (speculative/answers/distilled*), else off; a path is a folder of answers in that format; "off"
    corpus: str = "auto"

    @property
    def enabled(self) -> bool:
        return self.algorithm.upper() != "NONE"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine and its workers need to know; identical on every rank."""

    model_path: str = DEFAULT_MODEL
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    tp_size: int = 1
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    quantization: str = "auto"  # auto | none | int8 | int4 (worker/kernels/quant.py) | fp8 (worker/model/fp8.py)
    cpu_kernel: str = "auto"  # auto | bf16 | int8act | portable: what multiplies quantized weights on CPU (cpu_choice)
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    mem_fraction: float = 0.3  # of free memory given to the KV pool when max_total_tokens is None
    block_size: int = 16
    max_running_requests: int = 64
    # admission (runtime/engine.py): requests and prompt tokens in flight past the batch and the pool; None: 8x, 4x
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    chunked_prefill_size: int = 512
    grammar_compile_timeout: float = 5.0  # seconds rank 0's grammar compile may take before the request is refused
    max_model_len: int | None = None
    attention_backend: str = "auto"  # auto (triton on GPUs, torch on CPU) | torch (the reference) | triton (paged)
    enforce_eager: bool = False  # no graph capture on GPUs (worker/kernels/cuda_graph.py)
    cuda_graph_max_rows: int = 256  # the largest captured step, in rows (decode rows plus verify-tree rows)
    disable_radix_cache: bool = False  # rank 0's prefix cache (worker/prefix_cache.py) is on unless this is set
    # distributed
    dist_init_addr: str | None = None  # host:port of rank 0's rendezvous; None: a free local port
    nnodes: int = 1
    node_rank: int = 0
    dist_timeout: float = 60.0  # seconds; bounds every collective
    num_threads: int | None = None  # torch intra-op threads per worker; None: cores / local ranks
    seed: int = 0
    spec: SpecConfig = field(default_factory=SpecConfig)
    # reliability
    rank_consistency_check_interval: int = 1
    crash_dump_folder: str | None = None  # where each rank writes its last steps when it fails (worker/forensics.py)
    debug_rank_logit_noise: float = 0.0
    debug_rank_router_noise: float = 0.0  # tests: MoE router logits get rank * this much noise (rank 0 none)
    debug_skip_decision_broadcast: bool = False
    debug_collective_trace: str | None = None  # tests: each rank writes its collectives to DIR/rank{r}.json
    debug_corrupt_decision: int = 0  # tests: at this step the last rank alters one applied draft decision
    debug_graph_buffers_on_cpu: bool = False  # tests: run the graph path's static buffers on CPU, without capture
    startup_timeout: float = 600.0

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError("node_rank must be in [0, nnodes)")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.quantization not in TARGET_QUANTIZATION_CHOICES:
            raise ValueError(
                f"unknown quantization {self.quantization!r}; use {', '.join(TARGET_QUANTIZATION_CHOICES)}"
            )
        if self.cpu_kernel not in CPU_KERNEL_CHOICES:
            raise ValueError(f"unknown cpu kernel {self.cpu_kernel!r}; use {', '.join(CPU_KERNEL_CHOICES)}")
        if self.spec.draft_quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"unknown draft quantization {self.spec.draft_quantization!r}; use {', '.join(QUANTIZATION_CHOICES)}"
            )
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; use auto, torch or triton")
        if self.cuda_graph_max_rows < 1:
            raise ValueError("cuda_graph_max_rows must be >= 1")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0 seconds")
        if self.block_size < 1 or self.chunked_prefill_size < 1 or self.max_running_requests < 1:
            raise ValueError("block_size, chunked_prefill_size and max_running_requests must be >= 1")
        if self.debug_skip_decision_broadcast and not (self.debug_rank_logit_noise or self.debug_rank_router_noise):
            raise ValueError(
                "--debug-skip-decision-broadcast is refused without --debug-rank-logit-noise or router noise: "
                "it exists only to prove the divergence guard in tests"
            )
        s = self.spec
        if s.algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"unknown speculative algorithm {s.algorithm!r}")
        if s.enabled:
            if s.num_steps < 1 or s.eagle_topk < 1 or s.num_draft_tokens < 2:
                raise ValueError("speculative num_steps and eagle_topk must be >= 1, num_draft_tokens >= 2")
            candidates = s.eagle_topk + (s.num_steps - 1) * s.eagle_topk**2
            if s.num_draft_tokens - 1 > candidates:
                raise ValueError(
                    f"num_draft_tokens {s.num_draft_tokens} exceeds 1 + the {candidates} candidates "
                    f"that num_steps={s.num_steps}, topk={s.eagle_topk} propose"
                )
            if not 0 < s.accept_threshold_single <= 1 or not 0 < s.accept_threshold_acc <= 1:
                raise ValueError("speculative accept thresholds must be in (0, 1]")
            if s.context_tokens < 0 or s.context_ngram < 1:
                raise ValueError("speculative context tokens must be >= 0 and the context n-gram >= 1")

    @property
    def local_tp_size(self) -> int:
        return self.tp_size // self.nnodes
