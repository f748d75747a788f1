"""The model's own tokenizer and chat template, via transformers."""

from __future__ import annotations

from worker.model.files import ModelLoadError, ModelSource


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None):
    from transformers import AutoTokenizer

    try:
        if tokenizer_path:
            return AutoTokenizer.from_pretrained(tokenizer_path)
        if source.tokenizer_dir is not None:
            return AutoTokenizer.from_pretrained(str(source.tokenizer_dir))
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer for {source.path}: {e}") from e
