"""Build this rank's shard of the target model from a resolved source."""

from __future__ import annotations

import logging
import os

import torch

from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.kernels import cpu_choice
from worker.kernels.cpu_class import ONEDNN_BF16_FLAGS, onednn_bf16_linear
from worker.kernels.quant import METHOD_BITS, resolve_quantization
from worker.model.causal_lm import CausalLM
from worker.model.config import ModelConfig, load_model_config
from worker.model.files import ModelLoadError, ModelSource
from worker.model.layers import pack_cpu_linears, pack_fp8_linears, quantize_linears
from worker.model.weights import iter_checkpoint, load_weights

logger = logging.getLogger("eaglegate.loader")


def resolve_dtype(name: str, device: torch.device, quantized: bool = False) -> torch.dtype:
    """`quantized`: the load will keep or make quantized weights, whose CPU kernel then decides what `auto` means."""
    if name == "float32":
        return torch.float32
    if name == "float16":
        if device.type == "cpu":
            raise ValueError("float16 is supported on GPU only; use bfloat16 or float32 on CPU")
        return torch.float16
    if name == "bfloat16":
        if device.type == "cpu" and not onednn_bf16_linear():
            logger.warning(
                "--dtype bfloat16: this CPU lacks what oneDNN's bfloat16 linear needs (%s, or avx_ne_convert), so "
                "dense bfloat16 linears run on torch's generic kernel, slowly; --dtype auto picks float32 here",
                "+".join(ONEDNN_BF16_FLAGS),
            )
        return torch.bfloat16
    # auto: bfloat16 where the hardware has it; on CPU what the quantized linears' kernel serves best
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if quantized and cpu_choice.active().name == "int8act":  # float32 between the linears, as llama.cpp: faster
        return torch.float32  # there than widening bfloat16 at every op, and closer to the float32 reference
    cap = torch.backends.cpu.get_cpu_capability()
    wide = cap in ("AVX512", "AVX512_BF16", "AMX") or "AMX" in cap
    return torch.bfloat16 if wide and onednn_bf16_linear() else torch.float32


def will_quantize(config, source) -> bool:
    """Whether a load asks for quantized weights: a GGUF under `auto` (its own blocks), or int4/int8 asked for."""
    return config.quantization in ("int4", "int8") or (config.quantization == "auto" and source.kind == "gguf")


def check_tp_divisibility(cfg: ModelConfig, tp_size: int) -> None:
    if cfg.num_heads % tp_size:
        raise ModelLoadError(f"tp_size {tp_size} does not divide the {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % tp_size and tp_size % cfg.num_kv_heads:
        raise ModelLoadError(f"tp_size {tp_size} and the {cfg.num_kv_heads} KV heads: one must divide the other")
    if cfg.intermediate_size % tp_size:
        raise ModelLoadError(f"tp_size {tp_size} does not divide intermediate size {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % tp_size:
        raise ModelLoadError(
            f"tp_size {tp_size} does not divide the experts' intermediate size {cfg.moe_intermediate_size}"
        )
    if cfg.shared_expert_intermediate_size % tp_size:
        raise ModelLoadError(
            f"tp_size {tp_size} does not divide the shared expert's intermediate size "
            f"{cfg.shared_expert_intermediate_size}"
        )


def fp8_misaligned(cfg: ModelConfig, tp_size: int) -> str | None:
    """Where a rank's shard of a block-FP8 weight would end inside a block (its scales could not be split), or None."""
    if tp_size == 1:
        return None
    rows, cols = cfg.fp8_block
    heads = cfg.num_heads // tp_size
    q_width = cfg.qk_nope_head_dim + cfg.head_dim if cfg.mla else cfg.head_dim
    checks = [("query rows", heads * q_width, rows), ("o_proj columns", heads * (cfg.v_head_dim or cfg.head_dim), cols)]
    if not cfg.mla:
        checks.append(("key/value rows", max(1, cfg.num_kv_heads // tp_size) * cfg.head_dim, rows))
    for name, size in (
        ("MLP", cfg.intermediate_size),
        ("expert", cfg.moe_intermediate_size),
        ("shared expert", cfg.shared_expert_intermediate_size),
    ):
        if size:
            checks += [(f"{name} rows", size // tp_size, rows), (f"{name} down_proj columns", size // tp_size, cols)]
    bad = [f"{name} {size} per rank" for name, size, block in checks if size % block]
    return f"{', '.join(bad)} at tp {tp_size} split blocks of {list(cfg.fp8_block)}" if bad else None


def keeps_fp8(choice: str, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype) -> bool:
    """Whether a block-FP8 checkpoint's linears keep their FP8 bytes (the Triton GEMM) or load dequantized.
    auto: kept on GPUs where every rank's shard falls on block boundaries; fp8 insists (CPU only under Triton's
    interpreter, for tests)."""
    if cfg.fp8_block is None:
        if choice == "fp8":
            raise ModelLoadError("--quantization fp8 takes a block-FP8 checkpoint (quantization_config: fp8)")
        return False
    dense = f"block-FP8 weights load dequantized to {str(dtype).removeprefix('torch.')}"
    if choice not in ("auto", "fp8"):
        logger.info("%s (--quantization %s)", dense, choice)
        return False
    if tp.device.type != "cuda" and not (choice == "fp8" and os.environ.get("TRITON_INTERPRET") == "1"):
        if choice == "fp8":
            raise ModelLoadError("--quantization fp8 runs a Triton GEMM on GPUs; on CPU use auto (dequantized) or int4")
        logger.info("%s on %s", dense, tp.device.type)
        return False
    reason = fp8_misaligned(cfg, tp.size)
    if reason:
        if choice == "fp8":
            raise ModelLoadError(f"--quantization fp8 cannot shard this checkpoint: {reason}")
        logger.warning("%s: %s", dense, reason)
        return False
    return True


def load_target(
    config: EngineConfig, source: ModelSource, tp: TPGroup, dtype: torch.dtype, show_progress: bool = False
) -> tuple[CausalLM, ModelConfig]:
    cfg = load_model_config(source)
    check_tp_divisibility(cfg, tp.size)
    max_pos = config.max_model_len or cfg.max_position_embeddings
    model = CausalLM(
        cfg,
        tp,
        dtype,
        max_pos,
        router_noise=config.debug_rank_router_noise,
        local_routing=config.debug_skip_decision_broadcast,
    )
    try:
        keep = keeps_fp8(config.quantization, cfg, tp, dtype)
        method = (
            "fp8" if keep else resolve_quantization(config.quantization, dtype, tp.device, source.kind, config.dtype)
        )
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    model.weights_method = method  # the MTP draft's layer loads the same way (speculative/mtp.py)
    ignore = (r".*rotary_emb\.inv_freq",) + ((r"lm_head\.weight",) if cfg.tie_word_embeddings else ())
    # multi-token-prediction layers (GLM-4 MoE) follow the decoder layers in the checkpoint; serving does not use them
    ignore += tuple(rf"model\.layers\.{cfg.num_layers + i}\..*" for i in range(cfg.mtp_layers))
    try:
        load_weights(model, model.param_map(), iter_checkpoint(source, cfg, show_progress, method), ignore)
    except ValueError as e:  # a weight whose width does not split into quantization groups
        raise ModelLoadError(f"cannot quantize {source.path} with --quantization {config.quantization}: {e}") from e
    if method == "fp8":
        pack_fp8_linears(model, tp.device)
    model = model.to(tp.device).eval()
    if method not in ("none", "fp8"):
        quantize_linears(model, METHOD_BITS.get(method), dtype)
    if dtype == torch.bfloat16 and tp.device.type == "cpu":
        pack_cpu_linears(model)
    return model, cfg
