"""Messages between the front end and rank 0 (over pyzmq) and the plan rank 0 broadcasts each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams, TokenLogprobs

ERROR_CONTEXT_LENGTH = "context_length_exceeded"  # OpenAI's code for a prompt over the context limit
ERROR_ENGINE = "engine_error"


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class RequestOutput:
    """New tokens of one request since the last report; finish_reason set on its last report."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None  # set when the request failed (finish_reason "error")
    error_code: str | None = None  # why, for the front end's status: ERROR_CONTEXT_LENGTH (400) or ERROR_ENGINE (500)
    queue_seconds: float | None = None  # on a request's first report: arrival at rank 0 to first scheduling


@dataclass
class StepReport:
    """What rank 0 sends after each step: outputs plus engine stats (and step timings for metrics)."""

    outputs: list[RequestOutput]
    stats: dict
    step_metrics: dict = field(default_factory=dict)


@dataclass
class Ready:
    kv_total_tokens: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    load_seconds: float


@dataclass
class Fatal:
    message: str
    kind: str = "EngineDeadError"


@dataclass
class StepPlan:
    """Everything a rank needs to run one step identically to rank 0. Decided on rank 0 only."""

    step: int
    kind: str  # "forward" | "idle" | "shutdown"
    input_ids: list[int] = field(default_factory=list)
    seqs: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (ctx_len, q_len, block_table)
    sample_rows: list[int] = field(default_factory=list)  # flat token indices whose logits are needed
    spec: object | None = None  # a speculative decode step (speculative.plan.SpecStep) instead of the above
