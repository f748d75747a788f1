"""Executes a ForwardPlan on one rank: builds tensors, runs the sharded forward, returns logits.

Every rank runs this identically; only rank 0 looks at the logits to decide anything.
"""

from __future__ import annotations

import logging
import os

import torch

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.kernels import cpu as cpu_kernels
from worker.kernels.cuda_graph import GraphRunner, StaticBuffers, capture_sizes, step_rows
from worker.model.attention import build_attention_metadata
from worker.model.files import ModelSource
from worker.model.loader import load_target, resolve_dtype, will_quantize
from worker.model.moe import pack_fused_moe
from worker.model.seq_slice import SeqSlice
from worker.protocol import ForwardPlan

logger = logging.getLogger("eaglegate.runner")


def kv_cache_dtype(
    dtype: torch.dtype, device: torch.device, backend: str = "torch", mla: bool = False, quantized: bool = False
) -> torch.dtype:
    """The model dtype on GPUs; on CPU bfloat16 where the fused kernels attend for a bfloat16 or quantized model (it
    halves the bytes a step gathers from a cache the weights have evicted: int8act's served numerics, a quantized
    float32 model, decode a step at 300 tokens of context in 5.1 ms against 6.3 with float32 keys and values);
    float32 for the float32 reference, the CPU's eager and Triton-interpreter paths (attention.py) and latent
    attention, which the fused kernels do not run."""
    if device.type != "cpu":
        return dtype
    fused = backend == "torch" and cpu_kernels.ops(device) is not None and not mla
    return torch.bfloat16 if fused and (dtype == torch.bfloat16 or quantized) else torch.float32


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    values = sum(heads * width for layer in model.layers for heads, width in layer.self_attn.cache_widths)
    return values * torch.finfo(dtype).bits // 8


def kv_caches(attn_layers, slots: int, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """One (K, V) pair of [slots, heads, width] caches per attention module, shaped as the module asks (latent
    attention: one shared latent per token and an empty V)."""
    return [
        tuple(torch.zeros((slots, heads, width), dtype=dtype, device=device) for heads, width in attn.cache_widths)
        for attn in attn_layers
    ]


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


CPU_DEFAULT_MAX_TOKENS = 32768
GRAPH_MAX_CHUNK = 64  # a sequence's rows in a step up to which it may replay a graph (prefill chunks run eagerly)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """auto: the Triton paged kernels on GPUs (latent attention's own among them), the reference path on CPU."""
    return name if name != "auto" else ("triton" if device.type == "cuda" else "torch")


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, tp: TPGroup, show_progress: bool = False):
        self.config, self.tp, self.source = config, tp, source
        self.dtype = resolve_dtype(config.dtype, tp.device, will_quantize(config, source))
        self.model, self.model_cfg = load_target(config, source, tp, self.dtype, show_progress)
        self.attention_backend = resolve_attention_backend(config.attention_backend, tp.device)
        self.fused_moe = self.attention_backend == "triton" and self.model_cfg.num_experts > 0
        if self.fused_moe and pack_fused_moe(self.model) < len(self.model_cfg.moe_layers):
            self.fused_moe = False
            logger.warning("quantized experts have no fused MoE kernel: MoE layers run expert by expert, uncaptured")
        if self.fused_moe and tp.device.type == "cuda":
            torch.cuda.empty_cache()  # the per-expert copies' memory goes back, so the KV pool below can use it
        quantized = getattr(self.model, "weights_method", "none") in ("gguf", "int4", "int8")
        self.kv_dtype = kv_cache_dtype(self.dtype, tp.device, self.attention_backend, self.model_cfg.mla, quantized)
        self.block_size = config.block_size
        self.num_blocks = self._agree_num_blocks()
        graphs = self._graph_mode()
        # graph padding rows write one scratch block past the pool, which the scheduler never hands out
        slots = (self.num_blocks + (graphs is not None)) * self.block_size
        self.kv = kv_caches([layer.self_attn for layer in self.model.layers], slots, self.kv_dtype, tp.device)
        self.on_hidden = None  # speculative decoding stores the draft's features from every target forward
        self.noise_gen = torch.Generator(device=tp.device)
        self.noise_gen.manual_seed(1000 + tp.rank)
        self.graphs: GraphRunner | None = None
        if graphs is not None:
            max_pos = config.max_model_len or self.model_cfg.max_position_embeddings
            buffers = StaticBuffers(
                config.cuda_graph_max_rows,
                config.max_running_requests,
                -(-max_pos // self.block_size),
                self.num_blocks,
                self.block_size,
                tp.device,
            )
            self.graphs = GraphRunner(
                self.model, self.kv, buffers, capture_sizes(config.cuda_graph_max_rows), capture=graphs == "capture"
            )

    def _graph_mode(self) -> str | None:
        """ "capture" on CUDA/HIP with the Triton backend unless --enforce-eager; "static" for the CPU tests (the
        graph path's buffers and padding without capture); None: eager. MoE layers that run expert by expert read
        expert ids on the host, and collective traces record each call, so neither can be captured."""
        c = self.config
        if (
            c.enforce_eager
            or self.attention_backend != "triton"
            or (self.model_cfg.num_experts and not self.fused_moe)
            or c.debug_collective_trace
        ):
            return None
        if self.tp.device.type == "cuda":
            return "capture"
        return "static" if c.debug_graph_buffers_on_cpu else None

    def _agree_num_blocks(self) -> int:
        """Size the pool from the token budget, or from free memory; all ranks take the minimum."""
        if self.config.max_total_tokens:
            tokens = self.config.max_total_tokens
        else:
            tokens = int(available_memory(self.tp.device) * self.config.mem_fraction) // kv_bytes_per_token(
                self.model, self.kv_dtype
            )
            if self.tp.device.type == "cpu":
                tokens = min(tokens, CPU_DEFAULT_MAX_TOKENS)
        blocks = torch.tensor([max(1, tokens // self.block_size)], dtype=torch.int64)
        if self.tp.size > 1:
            import torch.distributed as dist

            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
        return int(blocks.item())

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Run the plan's tokens; returns (logits of sample_rows in float32, hidden states, aux hidden states)."""
        dev = self.tp.device
        slices = [SeqSlice(c, q, bt) for c, q, bt in plan.seqs]
        positions = [p for s in slices for p in range(s.ctx_len, s.ctx_len + s.q_len)]
        hidden, aux, slot_mapping = self.run_model(plan.input_ids, positions, slices)
        if self.on_hidden is not None:
            self.on_hidden(hidden, aux, slot_mapping)
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden[rows]).float()
        return self.perturb(logits), hidden, aux

    def run_model(
        self, ids: list[int], positions: list[int], slices: list[SeqSlice]
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The target forward for these rows: a graph replay when the step fits a captured bucket (short steps:
        decode, verify), else eager. Returns (hidden, aux hidden states, the cache slots written)."""
        if self.graphs is not None and max(s.q_len for s in slices) <= GRAPH_MAX_CHUNK:
            rows = step_rows(ids, positions, slices, self.block_size)
            bucket = self.graphs.bucket(rows)
            if bucket is not None:
                return self.graphs.run(rows, bucket)
        dev = self.tp.device
        meta = build_attention_metadata(slices, self.block_size, dev, self.attention_backend)
        hidden, aux = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            meta,
        )
        return hidden, aux, meta.slot_mapping

    def perturb(self, logits: torch.Tensor) -> torch.Tensor:
        """Fault injection: noise on every rank but 0, imitating all-reduce results that differ bit-wise by rank. Rank 0
        keeps its logits, so an engine that takes every decision from rank 0 gives tp=1's output."""
        scale = self.config.debug_rank_logit_noise
        if scale and self.tp.rank:
            noise = torch.randn(logits.shape, generator=self.noise_gen, device=logits.device)
            logits = logits + scale * noise
        return logits
