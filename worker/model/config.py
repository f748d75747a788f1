"""Architecture hyper-parameters read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from worker.model import fp8
from worker.model.files import ModelLoadError, ModelSource, file_identity, read_gguf

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # Qwen2's layout without q/k/v bias, with per-head RMSNorm on q and k
    "Qwen2MoeForCausalLM": "qwen2_moe",  # Qwen2 attention (q/k/v bias), sparse MoE with a gated shared expert
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 attention, sparse MoE MLPs (worker/model/moe.py)
    "MixtralForCausalLM": "mixtral",  # Mistral attention, sparse MoE MLPs
    # partial rotary, optional q/k norm; shared experts beside grouped sigmoid top-k routing with a score bias
    "Glm4MoeForCausalLM": "glm4_moe",
    # multi-head latent attention (worker/model/mla.py) beside grouped sigmoid MoE and an MTP layer
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",  # GLM-4.7-Flash
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
MLA_ARCHITECTURES = ("glm4_moe_lite", "deepseek_v3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a value of SUPPORTED_ARCHITECTURES, or a GGUF architecture (llama | mistral | qwen2)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: tuple[tuple[str, float | str], ...] = ()  # llama3 or yarn parameters and rope_type, sorted items
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before rotary embedding
    rotary_dim: int = 0  # the leading dims of each head that rotary embedding turns (0: all; GLM-4 MoE: half)
    # mixture of experts (0 experts: dense)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to one
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is sparse
    # "softmax": top-k of softmax(logits) (Mixtral, Qwen3-MoE); "grouped_sigmoid": DeepSeek-V3/GLM-4 routing, top-k
    # of sigmoid(logits) + a per-expert score bias within the best `topk_group` of `expert_groups` groups
    routing: str = "softmax"
    expert_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # a dense expert every token goes through (0: none)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output is scaled by sigmoid(a router column)
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last decoder layer (the MTP draft)
    # multi-head latent attention (kv_lora_rank 0: none). Each token caches its normed KV latent and its rotated
    # rope key (kv_lora_rank + qk_rope_head_dim values); head_dim is qk_rope_head_dim, the rotated width
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q comes straight from q_proj
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rope dims paired (x0, x1), (x2, x3), ... rather than split in halves
    fp8_block: tuple[int, int] | None = None  # a block-FP8 checkpoint's (rows, columns) per scale (worker/model/fp8.py)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling)


ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # DeepSeek-V3's context extension; the optional keys take transformers' defaults when absent
    "yarn": ("factor", "original_max_position_embeddings"),
}
YARN_OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def _rope_scaling(raw: dict | None, max_positions: int) -> tuple[tuple[str, float | str], ...]:
    if not raw:
        return ()
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return ()
    if kind not in ROPE_SCALING_KEYS:
        raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_SCALING_KEYS)}")
    items: dict[str, float | str] = {"rope_type": kind}
    for k in ROPE_SCALING_KEYS[kind]:
        if raw.get(k) is None and not (kind == "yarn" and k == "factor"):
            raise ModelLoadError(f"rope scaling {kind!r} needs {k!r}")
        items[k] = float(raw[k]) if raw.get(k) is not None else max_positions / float(raw[ROPE_SCALING_KEYS[kind][1]])
    if kind == "yarn":
        items |= {k: float(raw[k]) for k in YARN_OPTIONAL if raw.get(k) is not None}
    return tuple(sorted(items.items()))


def config_from_hf(hf: dict) -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unknown architecture {archs or hf.get('model_type')!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    heads = hf["num_attention_heads"]
    rope_params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type") not in (None, "default") else None)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    fields = dict(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads", heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2"
        or (arch == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
        or bool(hf.get("attention_bias", False)),
        rope_scaling=_rope_scaling(scaling, hf.get("max_position_embeddings", 4096)),
        fp8_block=fp8.block_size(hf),
        eos_token_ids=eos_ids,
        qk_norm=arch in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm", False)),
        rotary_dim=_rotary_dim(hf, hf.get("head_dim") or hf["hidden_size"] // heads, rope_params, arch),
    )
    return ModelConfig(**fields | _moe_fields(arch, hf) | _mla_fields(arch, hf))


def _mla_fields(arch: str, hf: dict) -> dict:
    if arch not in MLA_ARCHITECTURES:
        return {}
    return {
        "kv_lora_rank": hf["kv_lora_rank"],
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "head_dim": hf["qk_rope_head_dim"],
        "rotary_dim": 0,
        "num_kv_heads": hf["num_attention_heads"],  # a latent per token, expanded to every head
        "rope_interleave": bool(hf.get("rope_interleave", True)),
    }


def _moe_fields(arch: str, hf: dict) -> dict:
    if arch == "mixtral":
        return {
            "num_experts": hf["num_local_experts"],
            "experts_per_token": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["intermediate_size"],
            "norm_topk_prob": True,
            "moe_layers": tuple(range(hf["num_hidden_layers"])),
        }
    if arch in ("qwen2_moe", "qwen3_moe"):
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        experts = hf.get("num_experts", hf.get("num_local_experts", 0))  # Qwen's name, or transformers 5's
        layers = tuple(
            i for i in range(hf["num_hidden_layers"]) if i not in dense and experts > 0 and (i + 1) % step == 0
        )
        return {
            "num_experts": experts,
            "experts_per_token": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_layers": layers,
            **(
                {"shared_expert_intermediate_size": hf["shared_expert_intermediate_size"], "shared_expert_gate": True}
                if arch == "qwen2_moe"
                else {}
            ),
        }
    if arch in ("glm4_moe", "glm4_moe_lite", "deepseek_v3"):
        return _grouped_moe_fields(arch, hf)
    return {}


def _grouped_moe_fields(arch: str, hf: dict) -> dict:
    """GLM-4 MoE, GLM-4.7-Flash and DeepSeek-V3: dense first layers, grouped sigmoid routing, shared experts."""
    layers = hf["num_hidden_layers"]
    if hf.get("mlp_layer_types"):  # GLM-4.7-Flash in transformers 5
        sparse = tuple(i for i, kind in enumerate(hf["mlp_layer_types"][:layers]) if kind == "sparse")
    else:  # transformers' defaults where a config leaves them out
        dense = hf.get("first_k_dense_replace", 3 if arch == "deepseek_v3" else 1)
        sparse = tuple(range(dense, layers))
    return {
        "num_experts": hf["n_routed_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "moe_layers": sparse,
        "routing": "grouped_sigmoid",
        "expert_groups": hf.get("n_group") or 1,
        "topk_group": hf.get("topk_group") or 1,
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 1),
        "mtp_layers": hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0,
    }


def _rotary_dim(hf: dict, head_dim: int, rope_params: dict, arch: str) -> int:
    """GLM-4 MoE rotates half of each head (transformers' default partial_rotary_factor for it); others all."""
    factor = hf.get(
        "partial_rotary_factor", rope_params.get("partial_rotary_factor", 0.5 if arch == "glm4_moe" else 1.0)
    )
    return int(head_dim * factor)


def config_from_gguf(reader) -> ModelConfig:
    fields = reader.fields

    def get(key: str, default=None):
        f = fields.get(key)
        return f.contents() if f is not None else default

    arch = get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2"):
        raise ModelLoadError(f"unknown GGUF architecture {arch!r}; supported: llama, mistral, qwen2")
    heads = get(f"{arch}.attention.head_count")
    hidden = get(f"{arch}.embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    vocab = get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens"))
    eos = get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=int(heads),
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return _gguf_config(*file_identity(source.path))
    cfg_path = source.path / "config.json"
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    return config_from_hf(hf)


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, dev: int, inode: int, size: int, mtime_ns: int) -> ModelConfig:
    """Once per file and process: the front end reads it at every engine start, and parsing takes half a second."""
    try:
        reader = read_gguf(Path(path))
    except Exception as e:  # gguf raises assorted errors on truncated or corrupt files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    return config_from_gguf(reader)
