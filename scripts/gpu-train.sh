#!/usr/bin/env bash
# Train the EAGLE-3 head on a GPU host (a CUDA or ROCm torch): distil the ShareGPT first turns not answered yet,
# record the target's features for every answer, and train, warm-started from the shipped head.
#
#   scripts/gpu-train.sh OUTDIR [--bundle DIR]                          (make gpu-train OUT=OUTDIR)
#
# The inputs are token ids: train/examples.pt (the committed answers after their prompts) and train/prompts.pt (the
# prompts not answered yet), from a bundle made with `scripts/gpu-bundle.sh create --with-model --with-training`
# on a host without internet (build/gpu-bundle is used when present), or exported here first when there is none.
# Each phase runs in its own time box:
#   1. training/distill_runner.py answers the prompts greedily (a continuous batch through the model runner, dense
#      bfloat16 weights) for DISTILL_SECONDS (default 150), into OUTDIR/answers-gpu.jsonl.gz; committed as
#      speculative/answers/distilled-gpu/answers-NNN.jsonl.gz, serving and later training read them;
#   2. train-draft records features for the committed and the new answers and trains for TRAIN_SECONDS (default
#      140; the learning rate's cosine follows the time box), with the shipped head's recipe (TRAIN_ARGS overrides
#      it). The head lands in OUTDIR/head (config.json, README.md, curve.json, model.safetensors).
# Logs: OUTDIR/distill.log, OUTDIR/train.log. DEVICE=cpu BATCH=8 with small DISTILL_SECONDS and TRAIN_SECONDS try
# the whole path on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/gpu-env.sh  # takes OUTDIR, the first argument
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a folder}; shift ;;
    *) usage ;;
  esac
  shift
done
mkdir -p "$outdir" && outdir=$(cd "$outdir" && pwd)
work=${TMPDIR:-/tmp}/eaglegate-gpu-train
train=$work/inputs
if [ -n "$bundle" ]; then
  use_bundle
  [ "$MODEL_READY" = 1 ] || { echo "$bundle has no model: create it with --with-model"; exit 2; }
  [ -f "$bundle/train/examples.pt" ] || { echo "$bundle has no train/: create it with --with-training"; exit 2; }
  train=$bundle/train
else
  mkdir -p "$train"
  "$PYTHON" -m server train-draft --kind eagle3 --out "$work/export" --distilled --conversations \
    "${CONVERSATIONS:-0}" --max-len 512 --export-examples "$train/examples.pt" || exit 2
  "$PYTHON" -m training.distill_runner --export-prompts "$train/prompts.pt" --max-prompt-tokens 1024 || exit 2
fi
export EAGLEGATE_CPU_KERNELS=0 TQDM_MININTERVAL=20 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

device=${DEVICE:-cuda} distill_s=${DISTILL_SECONDS:-150} train_s=${TRAIN_SECONDS:-140}
SECONDS=0
rm -f "$work/gpu-examples.pt"
timeout $((distill_s + 90)) "$PYTHON" -m training.distill_runner --prompts "$train/prompts.pt" \
  --out "$outdir/answers-gpu.jsonl.gz" --examples-out "$work/gpu-examples.pt" --device "$device" \
  --batch "${BATCH:-1024}" --max-new-tokens 256 --max-prompt-tokens 1024 --max-len 512 --prefill-tokens 32768 \
  --seconds "$distill_s" 2>&1 | tee "$outdir/distill.log"
distill_status=${PIPESTATUS[0]}  # 124: stopped by its time box, which the runner's own --seconds should beat
examples=("$train/examples.pt")
[ -f "$work/gpu-examples.pt" ] && examples+=("$work/gpu-examples.pt")
echo "distilled in ${SECONDS} s; training on ${examples[*]}"

rm -rf "$work/head"
# shellcheck disable=SC2086
timeout $((train_s + 200)) "$PYTHON" -m server train-draft --kind eagle3 --out "$work/head" \
  --examples "${examples[@]}" --device "$device" --no-data-cache --max-len 512 --draft-vocab 8192 --unroll 3 \
  --init-from speculative/heads/smollm2-135m-instruct-eagle3 --max-seconds "$train_s" \
  ${TRAIN_ARGS:---epochs 4 --batch-size 16 --lr 3e-4 --bf16-autocast --checkpoint-every 200 --seed 3} \
  2>&1 | grep --line-buffered -v 'it/s\]$' | tee "$outdir/train.log"
status=${PIPESTATUS[0]}
if [ -f "$work/head/model.safetensors" ]; then
  mkdir -p "$outdir/head"
  cp "$work/head/config.json" "$work/head/README.md" "$work/head/curve.json" "$work/head/model.safetensors" \
    "$outdir/head/"
fi
echo "trained by ${SECONDS} s; head in $outdir/head"
[ "$status" = 0 ] || exit "$status"
exit "$distill_status"
