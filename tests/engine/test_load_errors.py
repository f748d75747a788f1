"""Each way a checkpoint can be wrong gives its own clear error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.engine import Engine, EngineDeadError
from worker.config import EngineConfig
from worker.dist import single_rank_group
from worker.model.files import GGUF_NAME, ModelLoadError, resolve_model
from worker.model.loader import load_target


def _load(path) -> None:
    load_target(
        EngineConfig(model_path=str(path)),
        resolve_model(str(path)),
        single_rank_group(torch.device("cpu")),
        torch.float32,
    )


@pytest.fixture()
def model_copy(tiny_llama, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama, dst)
    return dst


def _edit(folder, fn) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_unknown_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unknown architecture.*GPT2LMHeadModel"):
        _load(model_copy)


def test_missing_tensor(model_copy):
    _edit(model_copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match="missing tensors: model.layers.1.mlp.down_proj.weight"):
        _load(model_copy)


def test_leftover_tensor(model_copy):
    _edit(model_copy, lambda t: t.__setitem__("model.layers.7.extra.weight", torch.zeros(3)))
    with pytest.raises(ModelLoadError, match="unexpected tensors: model.layers.7.extra.weight"):
        _load(model_copy)


def test_shape_mismatch(model_copy):
    _edit(model_copy, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(100, 64)))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight: shape mismatch.*\(100, 64\).*\(128, 64\)"):
        _load(model_copy)


def test_truncated_safetensors(model_copy):
    path = model_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        _load(model_copy)


def test_truncated_gguf(smol_dir, tmp_path):
    src = smol_dir / GGUF_NAME
    dst = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        dst.write_bytes(f.read(src.stat().st_size // 3))
    with pytest.raises(ModelLoadError, match="truncated or corrupt|cannot read GGUF"):
        _load(dst)


def test_missing_path_and_engine_reports_load_error(model_copy):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(model_copy / "nope"))
    _edit(model_copy, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(EngineDeadError, match="ModelLoadError: checkpoint is missing tensors: model.norm.weight"):
        Engine(EngineConfig(model_path=str(model_copy), dtype="float32", max_total_tokens=256))
