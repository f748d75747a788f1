"""Small random models in real architectures' shapes, saved as Hugging Face folders (transformers' own config and
model classes, SmolLM2's tokenizer beside them), and EAGLE heads in the published formats: what the tests and the
benchmarks load instead of downloading anything."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model.files import default_model_dir, eaglegate_home

MLA_SHAPES = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "rope_interleave": True,
    "norm_topk_prob": True,
}


def save_tiny_model(
    folder: Path,
    arch: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    vocab: int = 49152,
    seed: int = 0,
    tie: bool = False,
) -> Path:
    """A random model whose logits are spread wide (no near-ties), with SmolLM2's tokenizer beside it."""
    import transformers

    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "glm4_moe_lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[arch]
    moe = {
        "qwen3_moe": {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": intermediate,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
        # a dense middle layer, a gated shared expert, unnormalised top-k weights, q/k/v bias
        "qwen2_moe": {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": intermediate,
            "shared_expert_intermediate_size": 2 * intermediate,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
        # GLM-4.5's shape in small: a dense first layer, 8 experts in 2 groups (top-1 group, top-2 experts), one
        # shared expert, scaled weights, q/k/v bias, q/k norm, rotary over half of each head
        "glm4_moe": {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": intermediate,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "num_nextn_predict_layers": 0,
        },
        # GLM-4.7-Flash's structure in small: latent attention with a low-rank q, interleaved rope, a dense first
        # layer, 8 experts in 2 groups with a score bias, one shared expert, scaled weights
        "glm4_moe_lite": MLA_SHAPES | {"q_lora_rank": 64, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.8},
        # DeepSeek-V3's: q straight from q_proj (no q_lora_rank), YaRN context extension, top-2 groups of 4
        "deepseek_v3": MLA_SHAPES
        | {
            "q_lora_rank": None,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 512,
                "mscale": 0.9,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    }.get(arch, {})
    cfg = cls[0](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **moe,
    )
    torch.manual_seed(seed)
    model = cls[1](cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif p.dim() == 1:
                p.normal_(0, 0.1)
            elif "embed" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.5 / p.shape[1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the expert choice: make it matter
                b.normal_(0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    if arch in ("glm4_moe_lite", "deepseek_v3"):
        add_mtp_layer(folder, cls, seed)
    tok_src = default_model_dir() / "tokenizer"
    for f in tok_src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def add_mtp_layer(folder: Path, classes, seed: int) -> None:
    """Append a multi-token-prediction layer as DeepSeek-V3 and GLM-4.7-Flash publish it: `model.layers.{n}` with
    enorm, hnorm, eh_proj, a sparse decoder layer (transformers' own class), shared_head.norm, and copies of the
    embedding and LM head (shared_head.head), beside `num_nextn_predict_layers: 1`."""
    import json

    from safetensors.torch import load_file, save_file

    raw = json.loads((folder / "config.json").read_text())
    n = raw["num_hidden_layers"]
    cfg = classes[0].from_pretrained(folder)
    if getattr(cfg, "mlp_layer_types", None):
        cfg.mlp_layer_types = list(cfg.mlp_layer_types) + ["sparse"]
    import sys

    module = sys.modules[classes[1].__module__]  # transformers' modeling file of this architecture
    layer_cls = getattr(module, classes[1].__name__.replace("ForCausalLM", "DecoderLayer"))
    torch.manual_seed(seed + 1)
    layer = layer_cls(cfg, n)
    state = load_file(folder / "model.safetensors")
    h, i = raw["hidden_size"], raw["moe_intermediate_size"]
    extra = {
        f"mlp.experts.{e}.{p}.weight": torch.randn(shape) * 1.5 / shape[1] ** 0.5
        for e in range(cfg.n_routed_experts)
        for p, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i)))
    }
    with torch.no_grad():
        for name, p in list(layer.state_dict().items()):
            if "experts" in name and p.dim() == 3:
                continue
            extra[name] = (
                torch.empty_like(p).uniform_(0.8, 1.2)
                if "norm" in name
                else torch.empty_like(p).normal_(0, 0.3)
                if p.dim() == 1
                else torch.empty_like(p).normal_(0, 1.5 / p.shape[-1] ** 0.5)
            )
    extra |= {
        "enorm.weight": torch.empty(h).uniform_(0.8, 1.2),
        "hnorm.weight": torch.empty(h).uniform_(0.8, 1.2),
        "shared_head.norm.weight": torch.empty(h).uniform_(0.8, 1.2),
        "eh_proj.weight": torch.randn(h, 2 * h) / (2 * h) ** 0.5,
        "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
        "shared_head.head.weight": state["lm_head.weight"].clone(),
    }
    state |= {f"model.layers.{n}.{k}": v.contiguous() for k, v in extra.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 1}))


def save_random_eagle_head(
    folder: Path,
    target_cfg,
    kind: str = "eagle",
    seed: int = 0,
    fmt: str = "safetensors",
    draft_vocab: int = 1024,
    fc_bias: bool = True,
) -> Path:
    """A randomly initialised draft head with the published key names and shapes (SafeAILab EAGLE / EAGLE-3)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, heads, kv, d, inter = (
        target_cfg.hidden_size,
        target_cfg.num_heads,
        target_cfg.num_kv_heads,
        target_cfg.head_dim,
        target_cfg.intermediate_size,
    )

    def w(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    state: dict[str, torch.Tensor] = {}
    if kind == "eagle":
        prefix, qkv_in = "layers.0.", h
        state["fc.weight"] = w(h, 2 * h)
        if fc_bias:
            state["fc.bias"] = torch.zeros(h)
    else:
        prefix, qkv_in = "midlayer.", 2 * h
        state["fc.weight"] = w(h, 3 * h)
        state["norm.weight"] = torch.ones(h)
        state["lm_head.weight"] = w(draft_vocab, h)
        state["d2t"] = torch.arange(draft_vocab) * 3  # draft id i -> target id 4i
        state["t2d"] = torch.zeros(target_cfg.vocab_size, dtype=torch.bool)
        state[prefix + "input_layernorm.weight"] = torch.ones(h)
        state[prefix + "hidden_norm.weight"] = torch.ones(h)
    state[prefix + "self_attn.q_proj.weight"] = w(heads * d, qkv_in)
    state[prefix + "self_attn.k_proj.weight"] = w(kv * d, qkv_in)
    state[prefix + "self_attn.v_proj.weight"] = w(kv * d, qkv_in)
    state[prefix + "self_attn.o_proj.weight"] = w(h, heads * d)
    state[prefix + "mlp.gate_proj.weight"] = w(inter, h)
    state[prefix + "mlp.up_proj.weight"] = w(inter, h)
    state[prefix + "mlp.down_proj.weight"] = w(h, inter)
    state[prefix + "post_attention_layernorm.weight"] = torch.ones(h)
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM" if kind == "eagle" else "LlamaForCausalLMEagle3"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta,
        "vocab_size": target_cfg.vocab_size,
        "bias": fc_bias,
    }
    if kind == "eagle3":
        config["draft_vocab_size"] = draft_vocab
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def save_copy_eagle_head(folder: Path, target_cfg, seed: int = 0) -> Path:
    """An EAGLE head that proposes 'the previous token again': fc passes the feature through and the layer adds
    nothing, so its logits are the target's own at the previous position. On repetitive text it is accepted
    often, which exercises multi-token commits, KV moves and finishes inside accepted runs."""
    import json

    from safetensors.torch import load_file, save_file

    save_random_eagle_head(folder, target_cfg, "eagle", seed=seed)
    state = load_file(str(folder / "model.safetensors"))
    h = target_cfg.hidden_size
    state["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    state["fc.bias"] = torch.zeros(h)
    state["layers.0.self_attn.o_proj.weight"].zero_()
    state["layers.0.mlp.down_proj.weight"].zero_()
    save_file(state, str(folder / "model.safetensors"))
    json.loads((folder / "config.json").read_text())
    return folder


def eagle_flags(head: Path) -> list[str]:
    """`eaglegate serve` flags for an EAGLE head on a small tree that drafts every step (no cost table)."""
    return ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6",
            "--speculative-cost-table", "off"]  # fmt: skip


def transformers_reference(model_dir: Path, gguf_name: str):
    """transformers' own float32 load of a GGUF, the independent reference for logits and greedy text. Reading the
    GGUF through transformers dequantizes in Python (about 15 s); the result is kept as safetensors under
    EAGLEGATE_HOME, keyed by the GGUF's digest and transformers' version: later sessions load it in about a second."""
    import transformers
    from transformers import AutoModelForCausalLM

    from runtime.agreement import file_digest

    key = f"{file_digest(model_dir / gguf_name)}-{transformers.__version__}"
    cached = eaglegate_home() / "transformers-reference" / f"{model_dir.name}-{key}"
    if (cached / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), gguf_file=gguf_name, dtype=torch.float32).eval()
    from safetensors.torch import save_model

    partial = cached.with_name(cached.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    # transformers refuses save_pretrained on a model read from a GGUF (its quantizer is attached), though every
    # weight is a plain float32 tensor by then: the tensors and the config are saved as they are
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (partial / "config.json").write_text(json.dumps(config))
    save_model(model, str(partial / "model.safetensors"))
    partial.rename(cached)  # whole or absent: a killed save never passes for the reference
    return model
