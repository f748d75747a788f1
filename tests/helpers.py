"""Shared test helpers: tiny random-weight Hugging Face models saved as safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from worker.model_files import default_model_dir


def save_tiny_model(folder: Path, arch: str = "llama", heads: int = 4, kv_heads: int = 2, layers: int = 2,
                    hidden: int = 64, intermediate: int = 128, vocab: int = 49152, seed: int = 0,
                    tie: bool = False) -> Path:
    """A random model whose logits are spread wide (no near-ties), with SmolLM2's tokenizer beside it."""
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]
    cfg = cls[0](vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
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
    model.save_pretrained(folder, safe_serialization=True)
    tok_src = default_model_dir() / "tokenizer"
    for f in tok_src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def descendants(pid: int) -> set[int]:
    """All live descendant pids of a process, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(p)
    return out
