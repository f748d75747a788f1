# Sourced by the gpu-*.sh scripts: the interpreter and the offline bundle they share.
# PYTHON picks the interpreter (default: .venv/bin/python where there is one, else python3); a bundle made by
# scripts/gpu-bundle.sh is used only when --bundle DIR names it (a host with internet needs none).

# usage: the calling script's header comment; OUTDIR is its first argument
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
outdir=${1:-}
case "$outdir" in ""|-*) usage ;; esac
shift

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PYTHON
bundle=""

# use_bundle: put the bundle's wheels, tokenizer and model in place (exports MODEL_READY and the bundle's paths)
use_bundle() {
  [ -n "$bundle" ] || return 0
  local bundle_env
  bundle_env=$(scripts/gpu-bundle.sh env "$bundle") || exit 2
  eval "$bundle_env"
}
