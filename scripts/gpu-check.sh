#!/usr/bin/env bash
# The GPU check, on any host with a CUDA or ROCm torch:
#
#   scripts/gpu-check.sh OUTDIR [--bundle DIR] [--machine CLASS]        (make gpu-check OUT=OUTDIR)
#
# 1. the `cuda`-marked tests (Triton kernels against the reference attention; greedy decoding on the GPU against the
#    CPU float32 reference, eager and captured; bfloat16 captured against eager; EAGLE lossless with a captured
#    verify) with EAGLEGATE_REQUIRE_CUDA=1, so a host whose torch sees no GPU fails them instead of skipping them;
# 2. bench/gpu.py: tokens/s eager against captured graphs, plain and with EAGLE, at concurrency 1, 16 and 64, on
#    SmolLM2-135M's shape with random weights, and on the real model with the shipped head where its GGUF is present.
#
# Everything goes into OUTDIR: env.txt (GPU, torch, triton, transformers), cuda-tests.xml (JUnit) and tests.log,
# gpu.json (gpu-CLASS.json with --machine; copy it to bench/results/) and bench.log. Exits non-zero when a step fails.
#
# A host without internet needs a bundle made elsewhere (scripts/gpu-bundle.sh create), named with --bundle DIR:
# its wheels, tokenizer and, if bundled, model are put in place first. PYTHON picks the interpreter
# (default: .venv/bin/python where there is one, else python3); TESTS_TIMEOUT and BENCH_TIMEOUT bound each step
# (seconds, default 1200 each).
set -uo pipefail
cd "$(dirname "$0")/.."

source scripts/gpu-env.sh  # takes OUTDIR, the first argument
machine=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a folder}; shift ;;
    --machine) machine=${2:?--machine needs a class}; shift ;;
    *) usage ;;
  esac
  shift
done
mkdir -p "$outdir" && outdir=$(cd "$outdir" && pwd)
use_bundle
if [ -z "${EAGLEGATE_COMMIT:-}" ] && commit=$(git rev-parse HEAD 2>/dev/null); then
  export EAGLEGATE_COMMIT=$commit
fi
export TRITON_INTERPRET=0 EAGLEGATE_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{
  date -u
  echo "commit ${EAGLEGATE_COMMIT:-unknown}${bundle:+, bundle $bundle}"
  nvidia-smi -L 2>/dev/null || rocm-smi --showproductname 2>/dev/null || echo "no nvidia-smi or rocm-smi"
  "$PYTHON" - <<'EOF'
import importlib
import torch
for name in ("torch", "triton", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")
print("cuda", torch.version.cuda, "hip", torch.version.hip, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(torch sees no GPU)")
EOF
} > "$outdir/env.txt" 2>&1
cat "$outdir/env.txt"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  echo "torch sees no CUDA or ROCm GPU here (see $outdir/env.txt): nothing to check"
  exit 3
fi

# the test files that hold `cuda`-marked tests, wherever the test tiers keep them; `-m cuda` picks the tests
mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.cuda' tests | sort)
[ ${#files[@]} -gt 0 ] || files=(tests)
status=0
timeout "${TESTS_TIMEOUT:-1200}" "$PYTHON" -m pytest "${files[@]}" -m cuda -q -p no:cacheprovider \
  --junitxml="$outdir/cuda-tests.xml" 2>&1 | tee "$outdir/tests.log" || status=1
timeout "${BENCH_TIMEOUT:-1200}" "$PYTHON" bench/gpu.py --out "$outdir/gpu${machine:+-$machine}.json" \
  ${machine:+--machine "$machine"} --work "${TMPDIR:-/tmp}/eaglegate-gpu-bench" 2>&1 | tee "$outdir/bench.log" || status=1
exit $status
