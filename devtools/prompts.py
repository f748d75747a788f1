"""Prompts and trees the tests and benchmarks share: a chat turn in the model's template, the questions the shipped
head is judged on, and the fixed tree a head's own quality is measured on."""

from __future__ import annotations

import argparse

from server.cli import add_engine_args
from speculative.defaults import resolve_spec_config


def chat(engine, text: str) -> str:
    """One user turn in the engine's chat template, ready for generation."""
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


QUESTIONS = [
    "Explain why the sky is blue.",
    "Write a short story about a robot who learns to paint.",
    "What are three tips for staying healthy?",
    "Describe how a bicycle works.",
]


def serve_args(*argv: str) -> argparse.Namespace:
    """`eaglegate serve`'s engine flags parsed as the CLI parses them."""
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def fixed_tree(head: str):
    """A head's own quality: a fixed 5-step, top-4, 12-token tree drafted every step, no context candidates
    (bench/head_accept.py measures heads on the same tree)."""
    return resolve_spec_config(
        serve_args("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
             "--speculative-num-steps", "5", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "12",
             "--speculative-cost-table", "off", "--speculative-context-tokens", "0")
    )  # fmt: skip
