#!/usr/bin/env bash
# An offline bundle for a GPU host without internet: a host with a CUDA or ROCm torch (and pytest, transformers and
# triton, as the PyTorch images have) that cannot download the rest.
#
#   scripts/gpu-bundle.sh create [DIR] [--with-model] [--max-part-size SIZE] [--with-training]
#       On a machine with internet and this checkout; DIR defaults to build/gpu-bundle (git-ignored). Fills DIR with
#       what the host lacks: wheels of pyzmq and gguf at the versions requirements.lock pins (BUNDLE_WHEELS names
#       others; BUNDLE_PYTHON_VERSION, default 3.12, and BUNDLE_ARCH, default x86_64, pick the host's build), the
#       tokenizer, the MT-bench questions and the commit id; about 4 MB.
#       --with-model        also the GGUF, split into parts of at most SIZE (split(1) sizes, default 40M) with its
#                           sha256, for copies that limit a file's size.
#       --with-training     also the token ids scripts/gpu-train.sh distils and trains on (train/examples.pt, the
#                           committed answers after their prompts; train/prompts.pt, the prompts not answered yet).
#
#   eval "$(scripts/gpu-bundle.sh env [DIR])"
#       On the host, from the checkout's root (scripts/gpu-check.sh and scripts/gpu-train.sh do this when given a
#       bundle): installs the wheels into a private folder, joins the GGUF's parts and checks the sha256, and prints
#       the environment to export: PYTHONPATH, EAGLEGATE_HOME, EAGLEGATE_COMMIT, and MODEL_READY (1 when the GGUF is
#       in place). Messages go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
cmd=${1:-}
[ $# -gt 0 ] && shift
dir=build/gpu-bundle
case "${1:-}" in --*|"") ;; *) dir=$1; shift ;; esac

create() {
  local with_model=0 with_training=0 part_size=40M
  while [ $# -gt 0 ]; do
    case "$1" in
      --with-model) with_model=1 ;;
      --with-training) with_training=1 ;;
      --max-part-size) part_size=$2; shift ;;
      *) usage ;;
    esac
    shift
  done
  local py=${PYTHON:-.venv/bin/python} arch=${BUNDLE_ARCH:-x86_64} platforms=() pins=() name
  mkdir -p "$dir"
  rm -rf "$dir/whl" "$dir/model" "$dir/train"
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do platforms+=(--platform "${p}_$arch"); done
  for name in ${BUNDLE_WHEELS:-pyzmq gguf}; do
    pins+=("$(grep -i "^$name==" requirements.lock || echo "$name")")
  done
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "${BUNDLE_PYTHON_VERSION:-3.12}" \
    --implementation cp "${platforms[@]}" -d "$dir/whl" "${pins[@]}"

  local model gguf home model_dir
  model=$("$py" -c 'from worker.model.files import fetch_default_model; print(fetch_default_model(quiet=True))')
  gguf=$("$py" -c 'from worker.model.files import GGUF_NAME; print(GGUF_NAME)')
  home=$("$py" -c 'from worker.model.files import eaglegate_home; print(eaglegate_home())')
  model_dir="$dir/home/$(basename "$model")"
  rm -rf "$dir/home" && mkdir -p "$model_dir" "$dir/home/data"
  cp -r "$model/tokenizer" "$model_dir/"
  if [ -f "$home/data/mt_bench_question.jsonl" ]; then
    cp "$home/data/mt_bench_question.jsonl" "$dir/home/data/"
  else
    echo "no MT-bench questions under $home/data (bench/spec.py fetches them); bench/gpu.py uses its own prompts" >&2
  fi
  git describe --always --dirty --abbrev=40 > "$dir/COMMIT"
  if [ "$with_model" = 1 ]; then
    mkdir -p "$dir/model"
    split -b "$part_size" -d -a 2 "$model/$gguf" "$dir/model/part-"
    sha256sum < "$model/$gguf" | cut -d' ' -f1 > "$dir/model/sha256"
    echo "$gguf" > "$dir/model/NAME"
    echo "$(basename "$model")" > "$dir/model/FOLDER"
  fi
  if [ "$with_training" = 1 ]; then
    mkdir -p "$dir/train"
    "$py" -m server train-draft --kind eagle3 --out "${TMPDIR:-/tmp}/eaglegate-train-export" --distilled \
      --conversations "${CONVERSATIONS:-0}" --max-len 512 --export-examples "$dir/train/examples.pt"
    "$py" -m training.distill_runner --export-prompts "$dir/train/prompts.pt" --max-prompt-tokens 1024
  fi
  du -sh "$dir" >&2
}

env_of() {
  [ -d "$dir/whl" ] || { echo "$dir is not a bundle: make one with 'scripts/gpu-bundle.sh create'" >&2; exit 2; }
  local site=${TMPDIR:-/tmp}/eaglegate-bundle-site py=${PYTHON:-python3} ready=0
  shopt -s nullglob
  local wheels=("$dir"/whl/*.whl) parts=("$dir"/model/part-*)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "${wheels[@]}" >&2
  fi
  if [ ${#parts[@]} -gt 0 ]; then
    local gguf
    gguf="$dir/home/$(cat "$dir/model/FOLDER")/$(cat "$dir/model/NAME")"
    if [ ! -f "$gguf" ] || [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" != "$(cat "$dir/model/sha256")" ]; then
      cat "${parts[@]}" > "$gguf"
    fi
    if [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" = "$(cat "$dir/model/sha256")" ]; then
      echo "the GGUF is in place ($(basename "$gguf") from ${#parts[@]} parts, sha256 checked)" >&2
      ready=1
    else
      echo "the parts in $dir/model do not make the GGUF (one is missing or damaged): no real model" >&2
      rm -f "$gguf"
    fi
  fi
  printf 'export PYTHONPATH=%q EAGLEGATE_HOME=%q MODEL_READY=%s\n' "$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$(cd "$dir/home" && pwd)" "$ready"
  [ -f "$dir/COMMIT" ] && printf 'export EAGLEGATE_COMMIT=%q\n' "$(cat "$dir/COMMIT")"
  return 0
}

case "$cmd" in
  create) create "$@" ;;
  env) env_of ;;
  *) usage ;;
esac
