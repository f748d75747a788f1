"""Start-up agreement: before loading, every rank states what it is about to serve and the ranks compare.

A rank with another dtype, checkpoint, head or setting would crash the first collective or serve wrong output.
Ranks gather each other's fingerprints (settings, shapes, file checksums); on any difference all raise the same
StartupMismatchError naming it. Paths may differ, contents not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from speculative.heads import resolve_draft_path
from worker.config import EngineConfig
from worker.dist import TPGroup
from worker.model.config import load_model_config
from worker.model.files import ModelSource, read_gguf

FULL_HASH_LIMIT = 1 << 30  # files up to 1 GiB are hashed whole; larger ones are sampled (SAMPLES chunks)
SAMPLES, CHUNK = 64, 1 << 20
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)
# settings that only describe this node or this process: they may differ between nodes
# (dtype, device, quantization and spec are compared in their resolved form below; the KV pool is agreed on by a
# minimum over ranks, so its sizing may differ too)
LOCAL_SETTINGS = {
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "node_rank",
    "dist_init_addr",
    "num_threads",
    "startup_timeout",
    "dist_timeout",
    "mem_fraction",
    "max_total_tokens",
    "max_queued_requests",  # admission is the front end's, on node 0 alone
    "max_queued_tokens",
    "grammar_compile_timeout",  # grammars compile on rank 0 alone
    "device",
    "dtype",
    "quantization",
    "cpu_kernel",
    "spec",
    "debug_collective_trace",
}


class StartupMismatchError(RuntimeError):
    """The ranks disagree about what they serve; nothing is served, every node exits non-zero."""


def file_digest(path: Path) -> str:
    """blake2b of the whole file, or of its size plus SAMPLES evenly spaced 1 MiB chunks above FULL_HASH_LIMIT."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    with path.open("rb") as f:
        if size <= FULL_HASH_LIMIT:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        else:
            h.update(size.to_bytes(8, "little"))
            for i in range(SAMPLES):
                f.seek((size - CHUNK) * i // (SAMPLES - 1))
                h.update(f.read(CHUNK))
    return h.hexdigest()


def files_digest(paths: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for p in sorted(paths, key=lambda p: p.name):
        h.update(p.name.encode())
        h.update(file_digest(p).encode())
    return h.hexdigest()


def _weight_files(source: ModelSource) -> list[Path]:
    if source.kind == "gguf":
        return [source.path]
    return sorted(source.path.glob("*.safetensors"))


def _tensor_index(source: ModelSource) -> str:
    """Digest of every tensor's name, shape and type, read from the file headers (no weights read)."""
    h = hashlib.blake2b(digest_size=16)
    if source.kind == "gguf":
        for t in read_gguf(source.path).tensors:
            h.update(f"{t.name}:{list(t.shape)}:{t.tensor_type.name};".encode())
    else:
        from safetensors import safe_open

        for path in _weight_files(source):
            with safe_open(str(path), "pt") as f:
                for name in sorted(f.keys()):
                    sl = f.get_slice(name)
                    h.update(f"{name}:{sl.get_shape()}:{sl.get_dtype()};".encode())
    return h.hexdigest()


def _tokenizer(config: EngineConfig, source: ModelSource) -> str:
    folder = Path(config.tokenizer_path) if config.tokenizer_path else source.tokenizer_dir
    files = [folder / n for n in TOKENIZER_FILES if folder is not None and (folder / n).exists()]
    return files_digest(files) if files else "embedded in the GGUF (covered by the weights)"


def fingerprint(
    config: EngineConfig,
    source: ModelSource,
    tp: TPGroup,
    dtype: torch.dtype,
    quantization: str,
    cpu_kernel: str = "",
) -> dict[str, str]:
    fp = {
        "dtype": str(dtype).removeprefix("torch."),
        "device type": tp.device.type,
        "collective backend": dist.get_backend(tp.group) if tp.size > 1 else "none",
        "quantization": quantization,
        "cpu kernel": cpu_kernel,
        "model config": json.dumps(dataclasses.asdict(load_model_config(source)), sort_keys=True, default=str),
        "tensor names and shapes": _tensor_index(source),
        "weights": files_digest(_weight_files(source)),
        "tokenizer": _tokenizer(config, source),
    }
    spec = config.spec
    if spec.enabled:
        if spec.draft_model_path is None:
            fp["draft head"] = "the checkpoint's MTP layer (covered by the weights)"
        else:
            head = resolve_draft_path(spec.draft_model_path)
            fp["draft head"] = files_digest([p for p in head.iterdir() if p.suffix in (".json", ".safetensors")])
        for f in dataclasses.fields(spec):
            if f.name != "draft_model_path":
                fp[f"speculative {f.name}"] = repr(getattr(spec, f.name))
    else:
        fp["speculative algorithm"] = "NONE"
    for f in dataclasses.fields(config):
        if f.name not in LOCAL_SETTINGS:
            fp[f.name] = repr(getattr(config, f.name))
    return fp


def _short(value: str) -> str:
    return value if len(value) <= 40 else value[:16] + "…"


def _nodes(ranks: list[int], node_of: list[int]) -> str:
    nodes = sorted({node_of[r] for r in ranks})
    return (
        f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} (rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))})"
    )


def compare(fingerprints: list[dict[str, str]], node_of: list[int]) -> str | None:
    """None when every rank agrees; else one message naming each difference and the nodes on each side."""
    keys = sorted(
        {k for fp in fingerprints for k in fp},
        key=lambda k: list(fingerprints[0]).index(k) if k in fingerprints[0] else 1 << 30,
    )
    parts = []
    for key in keys:
        values: dict[str, list[int]] = {}
        for rank, fp in enumerate(fingerprints):
            values.setdefault(fp.get(key, "<missing>"), []).append(rank)
        if len(values) > 1:
            sides = "; ".join(f"{_nodes(ranks, node_of)}: {_short(v)}" for v, ranks in values.items())
            parts.append(f"{key} differs: {sides}")
    if not parts:
        return None
    return "the TP ranks disagree at start-up, so nothing is served. " + " | ".join(parts)


def agree(
    config: EngineConfig, source: ModelSource, tp: TPGroup, dtype: torch.dtype, quantization: str, cpu_kernel: str = ""
) -> None:
    """Gather every rank's fingerprint; raise the same StartupMismatchError on every rank on any difference."""
    if tp.size == 1:
        return
    mine = fingerprint(config, source, tp, dtype, quantization, cpu_kernel)
    everyone: list[dict[str, str] | None] = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=tp.cpu_group)
    local = config.local_tp_size
    message = compare(everyone, [r // local for r in range(tp.size)])
    if message is not None:
        raise StartupMismatchError(message)
