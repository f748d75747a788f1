# Sourced by scripts/device-check.sh and scripts/device-train.sh on the device machine: installs the carried
# wheels, joins the staged GGUF parts (checked against the sha256 `prepare --with-model` recorded) and exports the
# environment. Sets MODEL_STAGED=1 when the real model is in place.
STAGE=/tmp/eaglegate-stage
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device/whl/*.whl || exit 2
MODEL_STAGED=0
if ls .device/model/part-* >/dev/null 2>&1; then  # the last part travels with the final call
  mkdir -p "$STAGE" && cp .device/model/part-* "$STAGE"/
fi
if ls "$STAGE"/part-* >/dev/null 2>&1; then
  gguf=.device/home/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
  cat "$STAGE"/part-* > "$gguf"
  if [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" = "$(cat .device/home/gguf.sha256 2>/dev/null)" ]; then
    echo "staged the GGUF from $(ls "$STAGE" | tr '\n' ' ')"
    MODEL_STAGED=1
  else  # a part is missing (the machine went back between calls)
    echo "the staged parts ($(ls "$STAGE" | tr '\n' ' ')) do not make the GGUF"
    rm -f "$gguf"
  fi
fi
export PYTHONPATH="/tmp/site:$PWD" EAGLEGATE_HOME="$PWD/.device/home" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
