#!/usr/bin/env bash
# System tools the test suite uses beyond the venv; installed when missing (Debian).
set -euo pipefail
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  elif [ "${CI:-}" = true ]; then
    echo "missing ${need[*]}, and CI needs every test to run" >&2
    exit 1
  else
    echo "missing ${need[*]}: the tests that need it are skipped" >&2
  fi
fi
