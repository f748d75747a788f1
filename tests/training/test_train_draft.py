"""`eaglegate train-draft` runs end to end on a tiny budget and produces a head the engine serves losslessly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from runtime.engine import Engine
from training.train import main as train_main
from worker.config import EngineConfig, SpecConfig
from worker.sampling.params import SamplingParams


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_train_draft_tiny_budget_end_to_end(tmp_path, smol_engine, kind):
    out = tmp_path / "head"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "train-draft",
        "--kind",
        kind,
        "--out",
        str(out),
        "--prompts",
        "builtin",
        "--num-prompts",
        "8",
        "--max-new-tokens",
        "24",
        "--max-len",
        "96",
        "--epochs",
        "2",
        "--batch-size",
        "4",
        "--draft-vocab",
        "2048",
        "--checkpoint-every",
        "2",
        "--dtype",
        "float32",
    ]
    if kind == "eagle3":
        # the path of scripts/gpu-train.sh: examples exported as token ids, then trained from that file; and
        # the bfloat16-autocast training path (weights stay float32)
        examples = tmp_path / "examples.pt"
        r = subprocess.run(cmd + ["--export-examples", str(examples)], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0 and examples.exists() and not (out / "data.pt").exists(), r.stderr[-2000:]
        # and EAGLE's soft labels: the target's top-K probabilities recorded beside the features; in parts of
        # about 100 tokens, so an interrupted recording has something to resume from
        cmd += ["--bf16-autocast", "--examples", str(examples), "--soft-topk", "4", "--part-tokens", "100"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "held-out expected accept length" in r.stdout
    config = json.loads((out / "config.json").read_text())
    facts = config["training"]
    assert facts["steps"] == 4 and config["draft_vocab_size"] == 2048 and config["eagle_kind"] == kind
    assert (out / "model.safetensors").exists() and "Reproduce:" in (out / "README.md").read_text()
    curve = json.loads((out / "curve.json").read_text())  # held-out accept length at each checkpoint
    assert [c["step"] for c in curve] == [2, 4] and all(c["heldout_tau"] >= 1.0 for c in curve)
    # each checkpoint is exported as a servable head (bench/spec_curve.py measures them)
    assert sorted(p.name for p in (out / "heads").iterdir()) == ["step-00002", "step-00004"]
    assert json.loads((out / "heads" / "step-00002" / "config.json").read_text())["eagle_kind"] == kind
    parts = sorted((out / "features").glob("part-*.pt"))
    assert parts and not (out / "data.pt").exists()
    record = out / "features" / "recording.json"
    assert json.loads(record.read_text())["complete"]
    if kind == "eagle3":  # a recording cut short: its last part is missing, and it never got to say it was done
        assert len(parts) >= 3
        lost = torch.load(parts[-1], weights_only=False)
        kept = [path.stat().st_mtime_ns for path in parts[:-1]]
        parts[-1].unlink()
        record.write_text(json.dumps(json.loads(record.read_text()) | {"complete": False}))
    if kind == "eagle":  # resuming runs the same code for both kinds: checked once, on EAGLE-3 below
        return
    # resumable: a second run with the checkpoint in place does no new steps and keeps the result; the recording
    # redoes only what is missing, and gets the same features
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r2.returncode == 0 and "resumed from step 4" in r2.stdout
    assert sorted((out / "features").glob("part-*.pt")) == parts
    if kind == "eagle3":
        assert [path.stat().st_mtime_ns for path in parts[:-1]] == kept  # only the missing part was recorded
        redone = torch.load(parts[-1], weights_only=False)
        assert redone["seqs"] == lost["seqs"]
        for name in ("feats", "labels", "masks", "soft_ids", "soft_p"):
            assert all(torch.equal(a, b) for a, b in zip(redone[name], lost[name])), name
        data = {
            k: [x for p in parts for x in torch.load(p, weights_only=False, mmap=True)[k]]
            for k in ("seqs", "labels", "soft_p", "soft_ids")
        }
        assert json.loads((out / "features" / "recording.json").read_text())["data"]["soft_topk"] == 4
        assert len(data["soft_p"]) == len(data["seqs"]) > len(redone["seqs"])
        first_p, first_ids = data["soft_p"][0].float(), data["soft_ids"][0]
        assert first_p.shape == (len(data["seqs"][0]), 4) and (first_p[:, :-1] >= first_p[:, 1:]).all()
        assert (first_ids[:, 0] == data["labels"][0]).all()  # the top choice is the greedy label
        assert (first_p.sum(-1) <= 1.001).all()
        # a cache recorded with soft labels is not silently trained on as hard labels (or the other way); the
        # command's own entry point, in this process (each run above already went through the command line)
        at = cmd.index("--soft-topk")
        hard = cmd[cmd.index("train-draft") + 1 : at] + cmd[at + 2 :]
        with pytest.raises(SystemExit, match=r"holds soft labels of top-4 \(0: none\), not --soft-topk 0"):
            train_main(hard)
        # nor is an unfinished recording finished with other settings
        record.write_text(json.dumps(json.loads(record.read_text()) | {"complete": False}))
        with pytest.raises(SystemExit, match="soft_topk: recorded 4, asked 0"):
            train_main(hard)
    assert_serves_losslessly(smol_engine, out)


def assert_serves_losslessly(smol_engine, head) -> None:
    """The engine serves `head` (float32) and its greedy output is plain greedy's."""
    prompt = smol_engine.encode("The quick brown fox")
    params = SamplingParams(max_new_tokens=16, temperature=0)
    ref = smol_engine.generate([prompt], params)[0].token_ids
    spec = SpecConfig("EAGLE", str(head), num_steps=3, eagle_topk=2, num_draft_tokens=6, cost_table="off")
    with Engine(EngineConfig(dtype="float32", max_total_tokens=2048, spec=spec)) as eng:
        assert eng.generate([prompt], params)[0].token_ids == ref


def test_soft_cross_entropy_reads_the_targets_top_k_inside_the_draft_vocabulary():
    from training.train import soft_cross_entropy

    vocab_index = torch.tensor([0, -1, 1, 2])  # target token 1 is outside the 3-token draft vocabulary
    logits = torch.randn(5, 3)
    labels = torch.tensor([0, 2, 3, 0, 2])
    one_hot_p = torch.tensor([[1.0, 0.0]] * 5)
    ids = torch.stack([labels, torch.full((5,), 1)], dim=1)
    # all the mass on one token: the hard cross-entropy on it
    hard = F.cross_entropy(logits, vocab_index[labels])
    assert torch.allclose(soft_cross_entropy(logits, ids, one_hot_p, vocab_index), hard)
    # mass on a token outside the draft vocabulary is dropped and the rest renormalised
    assert torch.allclose(soft_cross_entropy(logits, ids, torch.tensor([[0.5, 0.5]] * 5), vocab_index), hard)
    # split between two draft tokens: the mixture of their cross-entropies
    two = torch.tensor([[0, 3]] * 5)
    mixed = 0.75 * F.cross_entropy(logits, torch.zeros(5, dtype=torch.long)) + 0.25 * F.cross_entropy(
        logits, torch.full((5,), 2)
    )
    assert torch.allclose(soft_cross_entropy(logits, two, torch.tensor([[0.75, 0.25]] * 5), vocab_index), mixed)


@pytest.fixture(scope="module")
def float_smol():
    """The default model as training reads it: dense float32 weights, whichever kernel serves here."""
    from training.train import float_target

    return float_target(EngineConfig().model_path)


def test_warm_start_matches_lm_head_rows_by_token_when_the_draft_vocabulary_changes(float_smol):
    """More data picks another FR-Spec vocabulary: the saved head's rows must follow their token ids, not their
    positions, and tokens it never drafted start at zero (the target's rows would outscale the trained ones)."""
    import torch
    from safetensors.torch import load_file

    from speculative.defaults import DEFAULT_HEAD
    from training.train import warm_start
    from training.train_model import TrainableEagle3

    target, _ = float_smol
    saved = load_file(str(DEFAULT_HEAD / "model.safetensors"))
    old_vocab = torch.arange(len(saved["d2t"])) + saved["d2t"]
    drafted = set(old_vocab.tolist())
    unseen = torch.tensor([t for t in range(target.lm_head.weight.shape[0]) if t not in drafted][:100])
    new_vocab = torch.sort(torch.cat([old_vocab[100:], unseen])).values  # 100 tokens out, 100 others in
    head = TrainableEagle3(target, new_vocab)
    warm_start(head, str(DEFAULT_HEAD))
    row_of_old = {t: i for i, t in enumerate(old_vocab.tolist())}
    for row, token in enumerate(new_vocab.tolist()):
        want = saved["lm_head.weight"][row_of_old[token]].float() if token in row_of_old else torch.zeros(576)
        assert torch.equal(head.lm_head[row], want), token
    assert torch.equal(head.fc_w, saved["fc.weight"].float())


def test_a_wider_head_starts_as_the_saved_one_and_serves(tmp_path, smol_engine, float_smol):
    """--draft-intermediate: a head warm-started from a narrower one computes what it did (its new MLP units start
    with zero outputs), exports its width, and the engine serves it losslessly."""
    from safetensors.torch import load_file

    from speculative.defaults import DEFAULT_HEAD
    from speculative.heads import read_draft
    from training.train import export_head, warm_start
    from training.train_model import TrainableEagle3

    target, cfg = float_smol
    saved = load_file(str(DEFAULT_HEAD / "model.safetensors"))
    vocab = torch.arange(len(saved["d2t"])) + saved["d2t"]
    narrow, wide = TrainableEagle3(target, vocab), TrainableEagle3(target, vocab, intermediate=2048)
    for head in (narrow, wide):
        warm_start(head, str(DEFAULT_HEAD))
    assert wide.gate_up.shape == (4096, 576) and wide.down.shape == (576, 2048)
    assert wide.down[:, 1536:].abs().sum() == 0 and wide.gate_up[1536:2048].abs().sum() > 0  # new units: inputs only
    torch.manual_seed(0)
    ids, feats = torch.randint(0, 49152, (2, 40)), torch.randn(2, 40, 3 * 576)
    with torch.no_grad():
        for a, b in zip(narrow(ids, feats, 3, 0.0), wide(ids, feats, 3, 0.0)):
            assert torch.allclose(narrow.logits(a), wide.logits(b), atol=1e-4)
    with torch.no_grad():
        wide.down[:, 1536:] = torch.randn(576, 512) * 0.02  # as if trained: the new units now count
    export_head(wide, cfg, vocab, tmp_path, {"steps": 0})
    draft_cfg, _ = read_draft(tmp_path, cfg)
    assert json.loads((tmp_path / "config.json").read_text())["intermediate_size"] == 2048
    assert draft_cfg.layer.intermediate_size == 2048
    with pytest.raises(ValueError, match="2048 units, more than this head's 1536"):
        warm_start(TrainableEagle3(target, vocab), str(tmp_path))
    assert_serves_losslessly(smol_engine, tmp_path)


def test_unpacked_int4_linears_compute_what_the_kernel_computes():
    """Recording features at dense speed keeps the served int4 weights: the unpacked dense weight, multiplied by
    oneDNN, matches the int4 kernel on the same input to bfloat16 rounding."""
    import torch

    from worker.kernels.quant import pack, quantize_rtn
    from worker.model.layers import linear, unpack_quantized_linears

    torch.manual_seed(0)
    mod = torch.nn.Linear(64, 96, bias=False)
    mod.packed, mod.qweight = None, pack(quantize_rtn(mod.weight.data, 4), torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    want = linear(x, mod).float()
    assert unpack_quantized_linears(mod) == 1 and mod.qweight is None
    got = linear(x, mod).float()
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2) and not torch.equal(mod.weight.float(), torch.zeros(96, 64))


def test_runner_distillation_answers_as_the_engine_does(smol_engine):
    """training/distill_runner.py (the GPU's self-distillation: a continuous batch straight through the model runner)
    gives the engine's greedy answers: rows refilled as others finish, EOS kept, max_new_tokens respected."""
    import torch

    from training.distill_runner import greedy_answers
    from worker.dist import single_rank_group
    from worker.model.files import resolve_model
    from worker.runner import ModelRunner

    texts = [
        "Say hi.",
        "Count from one to twenty in words.",
        "Name a colour.",
        "What is 2+2? Answer briefly.",
        "Write one sentence about the sea.",
        "List three animals.",
    ]
    prompts = [
        smol_engine.encode(
            smol_engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
            )
        )
        for t in texts
    ]
    params = SamplingParams(max_new_tokens=24, temperature=0)
    ref = [r.token_ids for r in smol_engine.generate(prompts, params)]
    assert any(len(r) < 24 for r in ref) and any(len(r) == 24 for r in ref)  # both ways of finishing occur
    runner = ModelRunner(
        EngineConfig(dtype="float32", enforce_eager=True, max_total_tokens=512),
        resolve_model("smollm2-135m-instruct"),
        single_rank_group(torch.device("cpu")),
    )
    seen = []
    with torch.inference_mode():  # 3 rows at once and 512 cache slots: later prompts wait for finished rows' blocks
        got = greedy_answers(
            runner,
            list(enumerate(prompts)),
            24,
            tuple(runner.model_cfg.eos_token_ids),
            3,
            on_done=lambda i, a: seen.append(i),
        )
    assert [got[i] for i in range(len(prompts))] == ref
    assert sorted(seen) == list(range(len(prompts)))


def test_answer_examples_keep_the_answer_and_the_end_of_a_long_prompt(tmp_path):
    """A distilled answer after a long prompt (GPU prompts reach 1,024 tokens) keeps the whole answer and the prompt's
    end; second-turn answers are read apart from first-turn ones."""
    import gzip

    from training.distill import read_answers
    from training.train_data import answer_example

    prompt, answer = list(range(600)), list(range(1000, 1100))
    ids, spans = answer_example(prompt, answer, 512)
    assert len(ids) == 512 and ids[-100:] == answer and ids[:412] == prompt[-412:] and spans == [(412, 512)]
    ids, spans = answer_example(prompt[:100], list(range(1000, 1600)), 512)  # a long answer keeps 64 prompt tokens
    assert ids[:64] == prompt[36:100] and spans == [(64, 512)]
    assert answer_example([1, 2], [3, 4], 512) == ([1, 2, 3, 4], [(2, 4)])
    with gzip.open(tmp_path / "answers-000.jsonl.gz", "wt") as f:
        f.write('{"i":5,"ids":[1,2]}\n{"i":5,"turn":2,"ids":[3]}\n{"i":6,"ids":[]}\n')
    assert read_answers(tmp_path) == {5: [1, 2], 6: []} and read_answers(tmp_path, 2) == {5: [3]}
