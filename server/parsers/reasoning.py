"""Reasoning in `<think>...</think>` at the start of the output (DeepSeek-R1/V3, GLM-4.5+, Qwen3).

Reasoning is recognised only at the start (after whitespace), so `<think>` later in an answer stays content. It
starts inside the block when the chat template already wrote `<think>` into the prompt, or always for a parser that
assumes so (SGLang's `force_reasoning`: DeepSeek-R1 omits the start tag); an echoed start tag is dropped. It ends at
`</think>`, or where a tool call opens first (Qwen3.5 and GLM open calls without closing the block); output that ends
inside it is all reasoning. Reasoning is stripped of edge whitespace, and content loses the whitespace after
`</think>`.
"""

from __future__ import annotations

from .base import Spacing, find_marker, partial_tail

START, END = "<think>", "</think>"


class ThinkParser:
    def __init__(self, in_reasoning: bool, stops: tuple[str, ...] = ()):
        self.state = "reasoning" if in_reasoning else "start"
        self.echo = in_reasoning  # a start tag may still be echoed
        self.ends = (END, *stops)
        self.buf = ""
        self.reasoning = Spacing(lstrip=True)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text` makes final."""
        self.buf += text
        reasoning = ""
        if self.state == "start" or self.echo:
            head = self.buf.lstrip()
            if len(head) < len(START) and START.startswith(head):
                return "", ""  # could still be `<think>`
            if head.startswith(START):
                self.buf, self.state = head[len(START) :], "reasoning"
            elif self.state == "start":
                self.state = "content"
            self.echo = False
        if self.state == "reasoning":
            hit = find_marker(self.buf, self.ends)
            if hit is None:
                safe = len(self.buf) - partial_tail(self.buf, self.ends)
                reasoning, self.buf = self.reasoning.add(self.buf[:safe]), self.buf[safe:]
                return reasoning, ""
            at, marker = hit
            reasoning = self.reasoning.add(self.buf[:at])
            self.reasoning.drop()
            if marker == END:
                self.buf, self.state = self.buf[at + len(END) :], "after"
            else:  # the tool call opens the content
                self.buf, self.state = self.buf[at:], "content"
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return reasoning, ""
            self.state = "content"
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return self.reasoning.add(rest), ""
        return "", rest if self.state in ("start", "content") else ""

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        (r1, c1), (r2, c2) = self.feed(text), self.finish()
        return r1 + r2, c1 + c2
