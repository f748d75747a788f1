#!/usr/bin/env bash
# The prepared GPU training run for the EAGLE-3 head (issue #13): record the target's features and train, within
# 10 minutes on one H200. Like scripts/device-check.sh, in two halves:
#
#   scripts/device-train.sh prepare      here: the examples as token ids (self-distilled answers from
#                                        training/distilled/ plus ShareGPT conversations; no text travels, ~4 MB per
#                                        million tokens) into .device/train/, and what device-check.sh prepare
#                                        --with-model puts in .device/ (wheels, tokenizer, the GGUF in three parts)
#   run carry [".device/model/part-00"], command "scripts/device-check.sh stage"   }  back to back (the
#   run carry [".device/model/part-01"], command "scripts/device-check.sh stage"   }  machine stays warm 30 s)
#   run carry [".device/whl", ".device/home", ".device/COMMIT", ".device/train", ".device/model/part-02"],
#       command "scripts/device-train.sh"
#
# There it trains with --device cuda into /tmp/head and returns the head in $OUT: config.json, README.md and
# model.safetensors in 15 MB parts (files coming back are limited to 16 MB each); `cat head.part-* >
# model.safetensors` joins them. Training settings can be overridden with TRAIN_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  scripts/device-check.sh prepare --with-model
  mkdir -p .device/train
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m server train-draft --kind eagle3 --out /tmp/eaglegate-train-export --distilled \
    --conversations "${CONVERSATIONS:-4000}" --max-len 512 --export-examples .device/train/examples.pt
  du -sh .device/train
  exit 0
fi

: "${OUT:?run this through the device tool (it sets OUT), after 'scripts/device-train.sh prepare' here}"
[ -f .device/train/examples.pt ] || { echo "no .device/train/examples.pt: run 'prepare' here and carry it"; exit 2; }
. scripts/device-env.sh
[ "$MODEL_STAGED" = 1 ] || { echo "stage all three GGUF parts first (scripts/device-check.sh stage)"; exit 2; }

# defaults: the shipped head's recipe, with more epochs, which a GPU affords
# shellcheck disable=SC2086
timeout 540 python3 -m server train-draft --kind eagle3 --out /tmp/head --examples .device/train/examples.pt \
  --device cuda --max-len 512 --draft-vocab 8192 --unroll 3 ${TRAIN_ARGS:---epochs 6 --batch-size 16 --lr 5e-4} \
  2>&1 | grep -v 'it/s\]$' | tee "$OUT/train.log"
status=${PIPESTATUS[0]}
if [ -f /tmp/head/model.safetensors ]; then
  cp /tmp/head/config.json /tmp/head/README.md "$OUT"/
  split -b 15M -d -a 1 /tmp/head/model.safetensors "$OUT/head.part-"
fi
exit "$status"
