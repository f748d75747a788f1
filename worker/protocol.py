"""Messages between the front end and rank 0 (over pyzmq) and the plan rank 0 broadcasts each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.sampling.params import SamplingParams, TokenLogprobs
from worker.stats import EngineSnapshot, SpecCounts, StepMetrics

ERROR_CONTEXT_LENGTH = "context_length_exceeded"  # OpenAI's code for a prompt over the context limit
ERROR_ENGINE = "engine_error"
ERROR_INVALID_GRAMMAR = "invalid_grammar"  # a grammar rank 0 could not compile against the vocabulary (400)
FINISH_TIMEOUT = "timeout"  # finish_reason: the request ran past --request-timeout (rank 0's clock)
FINISH_DEAD_END = "grammar_dead_end"  # finish_reason: the grammar allows no next token (e.g. all banned by logit_bias)


@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AddRequests:
    """Requests submitted together arrive in one message, so rank 0 schedules them in the same step."""

    requests: list[AddRequest]


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
    error_code: str | None = None  # why, for the front end's status: ERROR_ENGINE is a 500, the others 400
    queue_seconds: float | None = None  # on a request's first report: arrival at rank 0 to first scheduling
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    spec: SpecCounts | None = None  # on a speculating request's last report: its own speculation figures
    sync_seconds: float | None = None  # on the last report: its steps' waits on rank 0's decision broadcasts


@dataclass
class StepReport:
    """What rank 0 sends after each step: outputs plus engine stats (and step timings for metrics)."""

    outputs: list[RequestOutput]
    stats: EngineSnapshot | None  # None: not due with this report; keep the last (leader.SNAPSHOT_INTERVAL_S)
    step_metrics: StepMetrics = field(default_factory=StepMetrics)


@dataclass
class Ready:
    kv_total_tokens: int
    max_model_len: int
    cpu_kernel: str = ""  # what multiplies quantized weights on CPU (worker/kernels/cpu_choice.py), "" on GPUs


@dataclass
class Fatal:
    message: str
    kind: str = "EngineDeadError"


@dataclass
class ForwardPlan:
    """One target forward over the batch's new tokens; rank 0 samples from `sample_rows`."""

    step: int
    input_ids: list[int] = field(default_factory=list)
    seqs: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (ctx_len, q_len, block_table)
    sample_rows: list[int] = field(default_factory=list)  # flat token indices whose logits are needed


@dataclass
class SpecSeq:
    ctx_len: int  # n: tokens with target KV; the root token x_n is extend_ids[-1]
    block_table: list[int]
    draft_cached: int  # positions [0, draft_cached) hold valid draft KV
    extend_ids: list[int]  # x_{t+1} for t in [draft_cached, n): the draft catches up on these positions
    context_ids: list[int] = field(default_factory=list)  # rank 0's chain candidates (prompt lookup or corpus)
    context_source: int = 2  # where the chain comes from: 2 the sequence's context, 4 the corpus (speculative/budget)


@dataclass
class SpecPlan:
    """A speculative decode step (speculative/): draft (unless rank 0 judged it unprofitable), verify, commit."""

    step: int
    seqs: list[SpecSeq]
    draft: bool = True  # False: verify the root and the context candidates only


@dataclass
class IdlePlan:
    """Nothing to run: the idle leader's heartbeat, so followers' collectives never time out."""

    step: int


@dataclass
class ShutdownPlan:
    step: int


# everything a rank needs to run one step identically to rank 0, decided on rank 0 only
StepPlan = ForwardPlan | SpecPlan | IdlePlan | ShutdownPlan
