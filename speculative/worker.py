"""The speculative step as every rank executes it: draft extend, tree expansion, target verify, KV commit.

Ranks run the same forwards in lockstep; each decision (draft candidates, frontier, selection, accepted path
and bonus token) comes from rank 0 through `Decider`, packed into one int64 broadcast per decision point.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from worker.config import EngineConfig, SpecConfig
from worker.dist import TPGroup
from worker.kernels import cpu_choice
from worker.kernels.quant import METHOD_BITS, QBlocks
from worker.kernels.triton_attention import MAX_TREE_NODES
from worker.model.attention import build_attention_metadata
from worker.model.files import ModelLoadError
from worker.model.layers import pack_cpu_linears, quantize_linears
from worker.model.moe import pack_fused_moe
from worker.model.seq_slice import SeqSlice, TreeKeys, slots_of
from worker.protocol import SpecPlan
from worker.runner import ModelRunner, kv_caches

from .budget import CostGrid, CostTable, timed_row
from .decisions import Commit, Selection, SpecDecisions
from .heads import DraftHead, load_draft_head, resolve_draft_path
from .mtp import MTPDraft, load_mtp_draft
from .tree import DraftTree, VerifyTree, build_verify_tree

# the verify forwards timed at start-up: tokens of context behind each sequence, batch sizes, rows per sequence (and
# the largest tree); the budget interpolates between them and extrapolates linearly beyond
CALIBRATION_CONTEXTS = (64, 512)
CALIBRATION_BATCHES = (1, 2, 4, 8, 16)
CALIBRATION_PER_SEQ = (1, 2, 3, 5)
CALIBRATION_WIDE = 8  # batches this wide are not timed past CALIBRATION_PER_SEQ's last tree
# speculate at a batch size while a second verify row per sequence costs at most 1.4x one row in the start-up
# timings: the shipped head's draft is accepted 43-46% of the time on MT-bench, so a wider row yields at most about
# 1.5 tokens per sequence before drafting and overheads. Measured on CPUs without AMX (4 clients at a ratio of
# 1.31-1.49 ran 0.94x plain) and with AMX (8 clients at 1.34 ran 1.13x), see docs/speculation.md
SECOND_ROW_LIMIT = 1.4


def draft_bits(choice: str, target: nn.Module) -> int | None:
    """The draft head's weight width on CPU (None: dense, in the target's dtype). auto: int8 beside a quantized
    target, where qlinear runs (either variant, worker/kernels/cpu_choice.py): a draft forward then streams about
    half the bytes of the dense head (bench/draft.py). The verify forward keeps the output exactly the target's
    whatever the draft proposes."""
    if choice == "none" or cpu_choice.active().name == "portable":
        return None
    if choice == "auto":
        quantized = any(isinstance(getattr(m, "qweight", None), QBlocks) for m in target.modules())
        return 8 if quantized else None
    return METHOD_BITS[choice]


def tree_width(spec: SpecConfig) -> int:
    """Nodes past the root a step's tree can hold: the verify tree (draft and context candidates) or the draft
    scratch (the fed draft levels), whichever is wider."""
    return max(spec.num_draft_tokens + spec.context_tokens, (spec.num_steps - 1) * spec.eagle_topk)


def check_tree_width(spec: SpecConfig, backend: str) -> None:
    """The Triton kernels carry a tree row's visible nodes as one int64 bitmask (`MAX_TREE_NODES`): refuse a tree
    wider than that at start-up, not at the first step (or the calibration) that builds one."""
    widest = tree_width(spec)
    if backend == "triton" and widest > MAX_TREE_NODES:
        raise ValueError(
            f"the speculative tree holds up to {widest} nodes (num_draft_tokens {spec.num_draft_tokens} "
            f"+ context tokens {spec.context_tokens}; draft levels {spec.num_steps - 1} x topk "
            f"{spec.eagle_topk}); the Triton attention backend takes at most {MAX_TREE_NODES}: lower "
            f"--speculative-num-draft-tokens or --speculative-context-tokens, or --speculative-num-steps "
            f"or --speculative-eagle-topk"
        )


def calibration_batches(max_running: int, disable_batch_size: int) -> tuple[int, ...]:
    """The batch sizes to time: those a speculative step can have (fewer than `disable_batch_size`, at most
    `max_running`), up to the first measured size that covers them all."""
    top = disable_batch_size - 1 if disable_batch_size else max_running
    out = []
    for b in (b for b in CALIBRATION_BATCHES if b <= max_running):
        out.append(b)
        if b >= top:
            break
    return tuple(out) or (1,)


def batch_limit(grid: CostGrid, configured: int) -> int:
    """The decode batch size from which rank 0 steps plainly: the first timed size (from 2) where, at either timed
    context, verifying two rows per sequence costs more than SECOND_ROW_LIMIT times one row; else `configured` (0:
    none)."""
    for b in grid.batches:
        if configured and b >= configured:
            break
        tables = [grid.at(b, c) for c in grid.contexts]
        if b >= 2 and any(t.verify(2 * b) > SECOND_ROW_LIMIT * t.verify(b) for t in tables):
            return b
    return configured


@dataclass
class SpecResult:
    commits: list[Commit]
    trees: list[VerifyTree]
    selections: list[Selection]
    verify_logits: torch.Tensor  # [sum(tree sizes), V] float32
    timings: dict = field(default_factory=dict)
    catch_up_seconds: float = 0.0  # of the draft phase: catching up past a drafting step's usual span (`_draft`)


def load_draft(config: EngineConfig, runner: ModelRunner, tp: TPGroup) -> DraftHead | MTPDraft:
    """The EAGLE head at --speculative-draft-model-path, else the target checkpoint's own MTP layer."""
    spec = config.spec
    if spec.draft_model_path is None:
        if spec.algorithm.upper() == "EAGLE3":
            raise ModelLoadError(
                "--speculative-algorithm EAGLE3 needs --speculative-draft-model-path (an EAGLE-3 head)"
            )
        draft = load_mtp_draft(config, runner.source, runner.model, tp, runner.dtype)
        if runner.fused_moe:  # its MoE layer on the target's fused kernels too
            pack_fused_moe(draft)
        return draft
    max_pos = runner.model.rope.cos.shape[0]
    return load_draft_head(resolve_draft_path(spec.draft_model_path), runner.model, tp, runner.dtype, max_pos)


class SpecWorker:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tp: TPGroup):
        self.config, self.runner, self.tp = config, runner, tp
        self.spec = config.spec
        check_tree_width(self.spec, runner.attention_backend)
        self.head: DraftHead | MTPDraft = load_draft(config, runner, tp)
        if self.spec.algorithm.upper() == "EAGLE3" and self.head.kind != "eagle3":
            raise ModelLoadError(
                f"--speculative-algorithm EAGLE3 needs an EAGLE-3 head; {self.spec.draft_model_path} "
                f"is an EAGLE-1/2 head (use EAGLE, which takes either layout)"
            )
        if runner.dtype == torch.bfloat16 and tp.device.type == "cpu":
            bits = draft_bits(self.spec.draft_quantization, runner.model)
            if bits:
                quantize_linears(self.head, bits, runner.dtype)
            pack_cpu_linears(self.head)
        if self.head.kind == "eagle3":
            runner.model.aux_layers = set(self.head.dcfg.aux_layers)
        slots = runner.num_blocks * runner.block_size
        self.draft_kv = kv_caches([self.head.attention], slots, runner.kv_dtype, tp.device)[0]
        # the target's own activations, unfused and in its dtype: a lossless copy (heads.DraftHead.stored)
        self.features = torch.zeros(slots, self.head.stored_width, dtype=runner.dtype, device=tp.device)
        runner.on_hidden = self._store_features
        self.bs, self.backend = runner.block_size, runner.attention_backend
        self.max_depth = self.spec.num_steps + self.spec.context_tokens  # longest path a verify tree can hold
        self.cost: CostGrid | CostTable | None = None
        if self.spec.cost_table == "auto":
            self.cost = self.calibrate()
        elif self.spec.cost_table != "off":
            self.cost = CostTable.load(self.spec.cost_table)
        self.batch_limit = self.spec.disable_batch_size  # rank 0's: decode batches this large step plainly (0: none)
        if self.spec.calibrate_batch_limit and isinstance(self.cost, CostGrid):
            self.batch_limit = batch_limit(self.cost, self.spec.disable_batch_size)

    @property
    def reserve(self) -> int:
        """KV slots past the root a decoding sequence needs: the verify tree and the draft scratch."""
        return tree_width(self.spec) + 1

    @torch.inference_mode()
    def calibrate(self) -> CostGrid:
        """Seconds of a verify forward (with its LM head) by context, batch size and rows per sequence, measured
        here before serving (a few seconds on CPU with batches up to 8). Every rank runs the same forwards
        (their collectives pair up); rank 0's timings are the ones it decides with."""
        top = self.spec.num_draft_tokens + self.spec.context_tokens
        per_seq = tuple(sorted({r for r in CALIBRATION_PER_SEQ if r < top} | {top}))
        batches = calibration_batches(self.config.max_running_requests, self.spec.disable_batch_size)
        max_pos = self.runner.model.rope.cos.shape[0]
        contexts = tuple(c for c in CALIBRATION_CONTEXTS if c + top <= max_pos) or (0,)
        dev, model = self.tp.device, self.runner.model

        def forward(ctx: int, batch: int, r: int) -> float:  # the serving path: a graph replay where it fits one
            need = -(-(ctx + r) // self.bs)  # each sequence its own blocks where the pool holds them (KV reads)
            ids, pos, slices = [], [], []
            for b in range(batch):
                table = [(b * need + i) % self.runner.num_blocks for i in range(need)]
                write = slots_of(table, range(ctx, ctx + r), self.bs)
                tree = TreeKeys(write, write, torch.ones(r, r, dtype=torch.bool).tril()) if r > 1 else None
                ids += [0] * r
                pos += list(range(ctx, ctx + r))
                slices.append(SeqSlice(ctx, r, table, tree))
            t0 = time.perf_counter()
            hidden, _, _ = self.runner.run_model(ids, pos, slices)
            model.compute_logits(hidden).float()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        # a wide batch (CALIBRATION_WIDE) is timed up to CALIBRATION_PER_SEQ's largest tree and extrapolated beyond
        # (about 10% high at 10 rows on CPU: a tree that wide rarely pays in a wide batch)
        cases = [
            (c, b, r)
            for c in contexts
            for b in batches
            for r in per_seq
            if b < CALIBRATION_WIDE or r <= CALIBRATION_PER_SEQ[-1]
        ]
        for case in (cases[-1], cases[0], cases[0]):  # warm-up: allocator, thread pool, packed weights
            forward(*case)
        times = {case: [] for case in cases}
        for _ in range(3):  # round-robin, so a burst of machine noise does not hit one case only
            for case in cases:
                times[case].append(forward(*case))
        measured = {case: sorted(t)[1] for case, t in times.items()}

        def row(c: int, b: int) -> tuple[float, ...]:
            return timed_row({r: measured[(c, b, r)] for r in per_seq if (c, b, r) in measured}, per_seq)

        return CostGrid(contexts, batches, per_seq, tuple(tuple(row(c, b) for b in batches) for c in contexts))

    def _store_features(self, hidden: torch.Tensor, aux: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        self.features.index_copy_(0, slot_mapping, self.head.stored(hidden, aux).to(self.features.dtype))

    # --- forwards ---------------------------------------------------------------------------------------
    def _draft_forward(
        self, ids: list[int], positions: list[int], feats: torch.Tensor, slices: list[SeqSlice]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.tp.device
        meta = build_attention_metadata(slices, self.bs, dev, self.backend)
        out = self.head(torch.tensor(ids, device=dev), feats, torch.tensor(positions, device=dev), self.draft_kv, meta)
        return out, meta

    @torch.inference_mode()
    def run(self, step: SpecPlan, decisions: SpecDecisions) -> SpecResult:
        t0 = time.perf_counter()
        trees = [DraftTree() for _ in step.seqs]
        contexts = [q.context_ids for q in step.seqs]
        catch_up = self._draft(step, decisions, trees, contexts) if step.draft else 0.0
        # without a draft, the plan already holds rank 0's choice of context tokens
        selections = decisions.select(trees, contexts) if step.draft else [Selection([], len(c)) for c in contexts]
        vtrees = [
            build_verify_tree(q.extend_ids[-1], t, sel.picks, ctx[: sel.num_context], q.context_source)
            for q, t, sel, ctx in zip(step.seqs, trees, selections, contexts)
        ]
        t1 = time.perf_counter()
        logits = self._verify_forward(step, vtrees)
        t2 = time.perf_counter()
        commits = decisions.accept(vtrees, logits, self.max_depth)
        t3 = time.perf_counter()
        self._commit_kv(step, vtrees, commits)
        return SpecResult(
            commits, vtrees, selections, logits, {"draft": t1 - t0, "verify": t2 - t1, "decide": t3 - t2}, catch_up
        )

    def _draft(self, step: SpecPlan, decisions: SpecDecisions, trees: list[DraftTree], contexts) -> float:
        """EAGLE drafting: catch the draft's KV up with committed tokens, then grow each tree level by level
        (rank 0 picks the children, the next frontier, and whether another level can pay). Returns the seconds
        spent catching up past the usual span."""
        s = self.spec
        k, B = s.eagle_topk, len(step.seqs)
        ids, pos, slots, slices, last = [], [], [], [], []
        for q in step.seqs:
            span = range(q.draft_cached, q.ctx_len)
            ids += q.extend_ids
            pos += list(span)
            slots += slots_of(q.block_table, span, self.bs)
            slices.append(SeqSlice(q.draft_cached, len(span), q.block_table))
            last.append(len(ids) - 1)
        t0 = time.perf_counter()
        feats = self.head.fuse(self.features.index_select(0, torch.tensor(slots, device=self.tp.device)))
        out, _ = self._draft_forward(ids, pos, feats, slices)
        # the share of this forward spent on tokens past a drafting step's usual catch-up (the root and the tokens
        # its last verify accepted): what a stretch of other steps left for the draft to catch up on
        steady = B * (self.spec.num_draft_tokens + self.spec.context_tokens + 1)
        catch_up = (time.perf_counter() - t0) * max(0, len(ids) - steady) / len(ids)
        root_hidden = out[torch.tensor(last, device=self.tp.device)]  # [B, h]
        logp = torch.log_softmax(self.head.logits(root_hidden), dim=-1)
        first = decisions.first(logp, k)  # [B, k] target-vocabulary tokens (rank 0's top-k)
        for b, t in enumerate(trees):
            for j in range(k):
                t.add(int(first[b, j]), -1, *decisions.score(b, j))
            t.frontier = list(range(k))
        src_hidden = {(b, c): root_hidden[b] for b in range(B) for c in range(k)}  # hidden that produced c
        for i in range(2, s.num_steps + 1):
            ids, pos, feats_list, slices = [], [], [], []
            for b, q in enumerate(step.seqs):
                t = trees[b]
                base = q.ctx_len + (i - 2) * k
                write = slots_of(q.block_table, range(base, base + k), self.bs)
                t.fed.extend(t.frontier)
                key_slots = slots_of(q.block_table, range(q.ctx_len, q.ctx_len + len(t.fed)), self.bs)
                slices.append(SeqSlice(q.ctx_len, k, q.block_table, TreeKeys(write, key_slots, t.feed_mask())))
                for c in t.frontier:
                    ids.append(t.tokens[c])
                    pos.append(q.ctx_len + t.depths[c] - 1)
                    feats_list.append(src_hidden[(b, c)])
            out, _ = self._draft_forward(ids, pos, torch.stack(feats_list), slices)
            logp = torch.log_softmax(self.head.logits(out), dim=-1).view(B, k, -1)
            children, picks, stop = decisions.expand(logp, trees, k, i == s.num_steps, contexts)
            for b, t in enumerate(trees):
                new = []
                for j, parent in enumerate(t.frontier):
                    for m in range(k):
                        c = t.add(int(children[b, j * k + m]), parent, *decisions.score(b, j * k + m))
                        new.append(c)
                        src_hidden[(b, c)] = out[b * k + j]
                t.frontier = [new[int(x)] for x in picks[b]] if picks is not None else []
            if stop:
                break
        return catch_up

    def _verify_forward(self, step: SpecPlan, vtrees: list[VerifyTree]) -> torch.Tensor:
        ids, pos, slices = [], [], []
        for q, vt in zip(step.seqs, vtrees):
            n = q.ctx_len
            write = slots_of(q.block_table, range(n, n + vt.size), self.bs)
            ids += vt.tokens
            pos += [n + d for d in vt.depths]
            slices.append(SeqSlice(n, vt.size, q.block_table, TreeKeys(write, write, vt.mask())))
        hidden, aux, slot_mapping = self.runner.run_model(ids, pos, slices)
        self._store_features(hidden, aux, slot_mapping)
        return self.runner.perturb(self.runner.model.compute_logits(hidden).float())

    def _commit_kv(self, step: SpecPlan, vtrees: list[VerifyTree], commits: list[Commit]) -> None:
        """Move the accepted nodes' target KV and features to consecutive positions after the root."""
        src, dst = [], []
        for q, commit in zip(step.seqs, commits):
            n = q.ctx_len
            for depth, node in enumerate(commit.path, start=1):
                if node != depth:
                    src += slots_of(q.block_table, [n + node], self.bs)
                    dst += slots_of(q.block_table, [n + depth], self.bs)
        if not src:
            return
        s = torch.tensor(src, device=self.tp.device)
        d = torch.tensor(dst, device=self.tp.device)
        for cache in [c for pair in self.runner.kv for c in pair] + [self.features]:
            cache.index_copy_(0, d, cache.index_select(0, s))
