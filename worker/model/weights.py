"""Stream checkpoint tensors (GGUF or safetensors) under Hugging Face names into a sharded model."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from worker.kernels.quant import (
    GGUF_EXACT,
    GGUF_REQUANT,
    GGUF_SUPPORTED,
    METHOD_BITS,
    QTensor,
    gguf_blocks,
    quantize_rtn,
)
from worker.model import fp8
from worker.model.config import ModelConfig
from worker.model.files import ModelLoadError, ModelSource, read_gguf

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp interleaves q/k rows for its rope layout; undo it to get Hugging Face's."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """The row order _unpermute_rope produces, to apply the same permutation to quantized rows."""
    return _unpermute_rope(torch.arange(n_rows).unsqueeze(1), n_heads).squeeze(1)


def gguf_tensor(t, method: str) -> torch.Tensor | QTensor:
    """One GGUF tensor as the load method wants it: the file's own blocks (Q4_0, Q4_1, Q8_0 under `gguf`, or when
    their width matches int4/int8), K-quants requantized to int4/int8 groups (`gguf`), else dense float32."""
    import gguf

    kind = t.tensor_type.name
    if kind not in GGUF_SUPPORTED:
        raise ModelLoadError(
            f"GGUF tensor {t.name} has type {kind}, which eaglegate cannot load; supported types: "
            f"{', '.join(GGUF_SUPPORTED)} (convert the file with llama.cpp's llama-quantize)"
        )
    bits = METHOD_BITS.get(method)
    if kind in GGUF_EXACT:
        blocks = gguf_blocks(np.asarray(t.data), kind, (int(t.shape[1]), int(t.shape[0])))
        if method == "gguf" or GGUF_EXACT[kind] == bits:
            return blocks
        return blocks.dequantize()  # gguf's own dequantization gives the same bits in twice the time
    w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
    if method == "gguf" and kind in GGUF_REQUANT and w.dim() == 2:
        return quantize_rtn(w, GGUF_REQUANT[kind])
    return w


def iter_gguf(
    path: Path, cfg: ModelConfig, show_progress: bool, method: str = "none"
) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    try:
        reader = read_gguf(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from e
    for t in tqdm(reader.tensors, desc="loading GGUF", unit="tensor", disable=not show_progress, leave=False):
        name = gguf_to_hf_name(t.name)
        if name is None:
            if t.name.startswith("rope_freqs"):
                continue
            yield t.name, torch.empty(0)  # reported as leftover
            continue
        w = gguf_tensor(t, method)
        heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
        if cfg.architecture in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = w.rows(_rope_rows(w.shape[0], heads)) if isinstance(w, QTensor) else _unpermute_rope(w, heads)
        yield name, w


def _safetensors_files(folder: Path, only: Callable[[str], bool] | None = None) -> list[str]:
    """The checkpoint's files (those holding a tensor `only` accepts, where an index says which)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"bad shard index {index}: {e}") from e
        files = sorted({f for name, f in weight_map.items() if only is None or only(name)})
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files and only is None:
        raise ModelLoadError(f"no *.safetensors files in {folder}")
    return files


def checkpoint_names(source: ModelSource) -> set[str]:
    """Every tensor name in the checkpoint, read from the headers only."""
    if source.kind == "gguf":
        return {t.name for t in read_gguf(source.path).tensors}
    from safetensors import safe_open

    names: set[str] = set()
    for fname in _safetensors_files(source.path):
        with safe_open(str(source.path / fname), framework="pt") as f:
            names |= set(f.keys())
    return names


def iter_safetensors(
    folder: Path, show_progress: bool, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(folder, only)
    for fname in tqdm(files, desc="loading safetensors", unit="file", disable=not show_progress, leave=False):
        try:
            with safe_open(str(folder / fname), framework="pt") as f:
                for key in f.keys():
                    if only is None or only(key):
                        yield key, f.get_tensor(key)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError on truncated files
            raise ModelLoadError(f"cannot read {folder / fname} (truncated or corrupt?): {e}") from e


def iter_checkpoint(
    source: ModelSource,
    cfg: ModelConfig,
    show_progress: bool,
    method: str = "none",
    only: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    """The checkpoint's tensors under Hugging Face names (those `only` accepts), quantized as `method` asks."""
    if source.kind == "gguf":
        tensors = iter_gguf(source.path, cfg, show_progress, method)
        return tensors if only is None else ((n, w) for n, w in tensors if only(n))
    tensors = iter_safetensors(source.path, show_progress, only)
    if cfg.fp8_block is not None:
        tensors = fp8.dequantize_stream(tensors, cfg.fp8_block, keep=method == "fp8")
    bits = METHOD_BITS.get(method)
    if bits is None:
        return tensors
    # quantize from the checkpoint's own precision, before anything rounds it to the model dtype; the embedding
    # table stays dense for lookups (a tied LM head is quantized from it after loading), and MoE routers stay
    # float32 (worker/model/moe.py: routing is exact)
    return ((name, quantize_rtn(w, bits) if w.dim() == 2 and not _stays_dense(name) else w) for name, w in tensors)


def _stays_dense(name: str) -> bool:
    """The embedding table, MoE routers, and latent attention's kv_b_proj (read per head, worker/model/mla.py)."""
    return "embed_tokens" in name or name.endswith(
        ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight", "kv_b_proj.weight")
    )


def load_weights(
    model: nn.Module,
    name_map: dict[str, tuple[str, object]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    ignore: tuple[str, ...] = (),
) -> None:
    """Feed each checkpoint tensor to its parameter's weight_loader; every parameter exactly once."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = set(name_map)
    seen: set[str] = set()
    leftover: list[str] = []
    for name, tensor in tensors:
        if name not in name_map:
            if not any(re.fullmatch(p, name) for p in ignore):
                leftover.append(name)
            continue
        pname, shard = name_map[name]
        param = params[pname]
        try:
            param.weight_loader(param, tensor, shard)
        except ValueError as e:
            raise ModelLoadError(f"{name}: {e}") from e
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
    if leftover:
        more = f" (+{len(leftover) - 5} more)" if len(leftover) > 5 else ""
        raise ModelLoadError(f"checkpoint has unexpected tensors: {', '.join(sorted(leftover)[:5])}{more}")
