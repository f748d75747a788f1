#!/usr/bin/env bash
# The prepared GPU run for the EAGLE-3 head (issue #13), sized for about 8 minutes on one H200: distil the ShareGPT
# first turns the CPU has not answered yet, record the target's features for every answer, train, and bring back the
# answers and the head. Like scripts/device-check.sh, in two halves:
#
#   scripts/device-train.sh prepare      here: as token ids only (no text travels),
#                                        .device/train/examples.pt (the committed answers after their prompts) and
#                                        .device/train/prompts.pt (the unanswered prompts), plus what
#                                        device-check.sh prepare --with-model puts in .device/ (wheels, tokenizer,
#                                        the GGUF in three parts)
#   run carry [".device/model/part-00"], command "scripts/device-check.sh stage"   }  back to back (the
#   run carry [".device/model/part-01"], command "scripts/device-check.sh stage"   }  machine stays warm 30 s)
#   run carry [".device/whl", ".device/home", ".device/COMMIT", ".device/train", ".device/model/part-02"],
#       command "scripts/device-train.sh"
#
# There, each phase in its own time box:
#   1. training/distill_runner.py answers the prompts greedily (a continuous batch through the model runner, dense
#      bfloat16 weights) for DISTILL_SECONDS, into $OUT/answers-gpu.jsonl.gz (commit it as
#      speculative/answers/distilled-gpu/answers-000.jsonl.gz);
#   2. train-draft --device cuda records features for the committed and the new answers and trains, warm-started
#      from the shipped head, for TRAIN_SECONDS (the learning rate's cosine follows the time box);
#   3. if time is left, the `cuda` tests (tests/test_cuda.py) for a first look at the GPU path.
# The head comes back in $OUT as config.json, README.md, curve.json and model.safetensors in 15 MB parts (`cat
# head.part-* > model.safetensors`). Training settings can be overridden with TRAIN_ARGS; DEVICE=cpu BATCH=8 with
# small DISTILL_SECONDS/TRAIN_SECONDS and a small .device/train try the whole path here (the GGUF need not be staged).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  scripts/device-check.sh prepare --with-model
  mkdir -p .device/train
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m server train-draft --kind eagle3 --out /tmp/eaglegate-train-export --distilled \
    --conversations "${CONVERSATIONS:-0}" --max-len 512 --export-examples .device/train/examples.pt
  "$PY" -m training.distill_runner --export-prompts .device/train/prompts.pt --max-prompt-tokens 1024
  du -sh .device/train
  exit 0
fi

: "${OUT:?run this through the device tool (it sets OUT), after 'scripts/device-train.sh prepare' here}"
[ -f .device/train/examples.pt ] || { echo "no .device/train/examples.pt: run 'prepare' here and carry it"; exit 2; }
. scripts/device-env.sh
[ "$MODEL_STAGED" = 1 ] || [ "${DEVICE:-cuda}" = cpu ] || { echo "stage all three GGUF parts first (scripts/device-check.sh stage)"; exit 2; }

export EAGLEGATE_CPU_KERNELS=0 TQDM_MININTERVAL=20  # the GPU needs no CPU kernels built; a quieter log
SECONDS=0
timeout $((${DISTILL_SECONDS:-150} + 90)) python3 -m training.distill_runner --prompts .device/train/prompts.pt \
  --out "$OUT/answers-gpu.jsonl.gz" --examples-out /tmp/gpu-examples.pt --device "${DEVICE:-cuda}" --batch "${BATCH:-1024}" \
  --max-new-tokens 256 --max-prompt-tokens 1024 --max-len 512 --prefill-tokens 32768 --seconds "${DISTILL_SECONDS:-150}" 2>&1 \
  | tee "$OUT/distill.log"
examples=(.device/train/examples.pt)
[ -f /tmp/gpu-examples.pt ] && examples+=(/tmp/gpu-examples.pt)
echo "distilled in ${SECONDS} s; training on ${examples[*]}"

# the shipped head's recipe, warm-started from it, in a time box (a GPU affords several epochs)
# shellcheck disable=SC2086
timeout $((${TRAIN_SECONDS:-140} + 200)) python3 -m server train-draft --kind eagle3 --out /tmp/head \
  --examples "${examples[@]}" --device "${DEVICE:-cuda}" --no-data-cache --max-len 512 --draft-vocab 8192 --unroll 3 \
  --init-from speculative/heads/smollm2-135m-instruct-eagle3 --max-seconds "${TRAIN_SECONDS:-140}" \
  ${TRAIN_ARGS:---epochs 4 --batch-size 16 --lr 3e-4 --bf16-autocast --checkpoint-every 200 --seed 3} \
  2>&1 | grep -v 'it/s\]$' | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
if [ -f /tmp/head/model.safetensors ]; then
  cp /tmp/head/config.json /tmp/head/README.md /tmp/head/curve.json "$OUT"/
  split -b 15M -d -a 1 /tmp/head/model.safetensors "$OUT/head.part-"
fi
echo "trained by ${SECONDS} s"
if [ "$SECONDS" -lt "${TESTS_BEFORE:-420}" ]; then  # a first look at the GPU path, if time is left
  export TRITON_INTERPRET=0 EAGLEGATE_REQUIRE_CUDA=1
  timeout 60 python3 -m pytest tests/test_cuda.py -m cuda -q -x -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/cuda-tests.log"
fi
exit "$status"
