"""Output parsers chosen by `--reasoning-parser` and `--tool-call-parser`: reasoning blocks and tool calls in the
formats of GLM-4.5+, DeepSeek-V3/V3.1 and Qwen3, streamed or whole (`registry.py` names them, `base.py` explains the
streaming contract)."""
