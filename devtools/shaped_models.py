"""Random-weight models in the published shapes of the MoE models operators serve, fewer layers: what bench/gpu.py
measures on a host that has no weights. transformers' own config classes default to the published widths:

- `qwen3_moe_shaped`: Qwen3-30B-A3B's layer (hidden 2048, 32 heads / 4 KV heads of 128, 128 experts top-8 of
  intermediate 768, vocabulary 151,936);
- `glm_flash_shaped`: GLM-4.7-Flash's (latent attention: q_lora 768, kv_lora 512, nope 192, rope 64, v 256, 20
  heads; 64 experts top-4 of intermediate 1536 and a shared expert, a dense first layer, vocabulary 154,880) with
  its MTP layer.

Per-layer cost does not depend on the weights' values, so a step's time is the real model's per layer."""

from __future__ import annotations

from pathlib import Path

import torch

from devtools.models import add_mtp_layer
from worker.model.files import default_model_dir


def _save(folder: Path, config, model_cls) -> Path:
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for f in (default_model_dir() / "tokenizer").iterdir():  # any tokenizer serves random weights
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def qwen3_moe_shaped(folder: Path, layers: int = 4) -> Path:
    import transformers

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=layers, head_dim=128, max_position_embeddings=8192)
    return _save(folder, cfg, transformers.Qwen3MoeForCausalLM)


def glm_flash_shaped(folder: Path, layers: int = 4) -> Path:
    import transformers

    if (
        '"num_nextn_predict_layers": 1' in (folder / "config.json").read_text()
        if (folder / "config.json").exists()
        else ""
    ):
        return folder
    cfg = transformers.Glm4MoeLiteConfig(
        num_hidden_layers=layers, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), max_position_embeddings=8192
    )
    _save(folder, cfg, transformers.Glm4MoeLiteForCausalLM)
    classes = (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM)
    add_mtp_layer(folder, classes, seed=0)  # config.json last: a whole folder
    return folder
