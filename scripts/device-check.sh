#!/usr/bin/env bash
# The one prepared GPU check (issue #17), sized for 8 minutes on one H200. Two halves:
#
#   scripts/device-check.sh prepare     here, on the CPU machine, once per session: fills .device/ (git-ignored)
#                                       with what the device image lacks (pyzmq and gguf wheels, the tokenizer,
#                                       the MT-bench questions, the commit id); about 4 MB
#   scripts/device-check.sh             there, through the device tool's `run` with carry [".device"] (without the
#                                       model parts below: carry .device/whl, .device/home and .device/COMMIT)
#
# There it runs the `cuda` tests (Triton kernels vs the reference attention; greedy on the GPU vs the CPU float32
# reference, eager and captured; bfloat16 captured vs eager; EAGLE lossless with captured verify) with
# EAGLEGATE_REQUIRE_CUDA=1, so none is skipped silently, then bench/gpu.py: tok/s eager vs captured, plain and
# EAGLE, at concurrency 1, 16 and 64. Everything lands in $OUT: env.txt, cuda-tests.xml, tests.log, gpu.json,
# bench.log. The bench always measures SmolLM2-135M's shape with random weights (plain decoding costs the same
# whatever the weights). The real 98 MB GGUF exceeds what one call carries (64 MiB, the 21 MB tree included), so it
# travels in parts when wanted:
#
#   scripts/device-check.sh prepare --with-model     here: also splits the GGUF into .device/model/part-00..02
#   run carry [".device/model/part-00"], command "scripts/device-check.sh stage"   }  back to back: the machine
#   run carry [".device/model/part-01"], command "scripts/device-check.sh stage"   }  stays warm only 30 s
#   run carry [".device/whl", ".device/home", ".device/COMMIT", ".device/model/part-02"],
#       command "scripts/device-check.sh"                             (assembles the parts; the engine checks the sha256)
#
# then the bench also measures the real model with the shipped EAGLE-3 head.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  set -e
  grep -qxF '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
  rm -rf .device/whl && mkdir -p .device/whl .device/home/smollm2-135m-instruct .device/home/data
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .device/whl \
    "$(grep -i '^pyzmq==' requirements.lock)" "$(grep -i '^gguf==' requirements.lock)"
  home=$("$PY" -c 'from worker.model.files import fetch_default_model; print(fetch_default_model(quiet=True))')
  cp -r "$home/tokenizer" .device/home/smollm2-135m-instruct/
  mt=$("$PY" -c 'from worker.model.files import eaglegate_home; print(eaglegate_home() / "data")')/mt_bench_question.jsonl
  [ -f "$mt" ] && cp "$mt" .device/home/data/
  git describe --always --dirty --abbrev=40 > .device/COMMIT
  rm -rf .device/model
  if [ "${2:-}" = --with-model ]; then
    mkdir -p .device/model
    split -b 40M -d -a 2 "$home/SmolLM2-135M-Instruct.Q4_1.gguf" .device/model/part-
    sha256sum < "$home/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1 > .device/home/gguf.sha256
  fi
  du -sh .device
  exit 0
fi

STAGE=/tmp/eaglegate-stage
if [ "${1:-}" = stage ]; then  # there: keep the carried model parts for the final call
  mkdir -p "$STAGE" && cp -v .device/model/part-* "$STAGE"/
  exit 0
fi

: "${OUT:?run this through the device tool (it sets OUT), after 'scripts/device-check.sh prepare' here}"
[ -d .device/whl ] || { echo "no .device/: run 'scripts/device-check.sh prepare' first and carry .device"; exit 2; }
. scripts/device-env.sh  # wheels, the staged GGUF if all its parts came (else the random-weight model only)
export EAGLEGATE_COMMIT="$(cat .device/COMMIT)" TRITON_INTERPRET=0 EAGLEGATE_REQUIRE_CUDA=1
{ date -u; nvidia-smi -L 2>&1; python3 -c 'import torch, triton, transformers; print("torch", torch.__version__,
  "triton", triton.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda,
  "hip", torch.version.hip)'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
timeout 220 python3 -m pytest tests/test_cuda.py tests/test_triton_attention.py -m cuda -q -p no:cacheprovider \
  --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/tests.log" || status=1
timeout 240 python3 bench/gpu.py --out "$OUT/gpu.json" --work /tmp/eaglegate-gpu 2>&1 \
  | grep -v 'Loading\|loading\|Writing' | tee "$OUT/bench.log" || status=1
exit $status
