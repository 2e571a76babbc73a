#!/usr/bin/env bash
# One H200: Llama-3.1-8B-Instruct, CUDA graphs on (SGLang's defaults), prefix cache on.
# Exported requests recompute their prompt; everything else keeps the cache.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-3.1-8B-Instruct}
OUT=${OUT:-/dev/shm/hs-llama3-8b}
DATA=${DATA:-sharegpt.jsonl}

# 1. Serve. --attention-backend triton on this host (its FlashAttention-3 build is not shipped).
python -m sglang.launch_server --model-path $MODEL --port 30000 \
    --attention-backend triton --sampling-backend pytorch \
    --export-hidden-states-dir $OUT --skip-server-warmup > server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:30000/health > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see server.log" >&2; tail -n 30 server.log >&2; exit 1; }
    sleep 5
done

# 2. Capture: 64 requests in flight keep the prefill batches full; --max-length keeps the
#    first 4096 tokens of longer chats.
sglang-hs capture --server http://127.0.0.1:30000 --data $DATA --out $OUT --concurrency 64 --max-length 4096

# 3. Stop the server (it holds most of the GPU), check a sample of the rows against HF on the
#    same GPU (verify loads the model twice: fp32 and bf16), then write SpecForge's layout.
kill $SERVER; wait $SERVER 2>/dev/null || true
trap - EXIT
sglang-hs verify $OUT --samples 16 --device cuda
rm -rf ${OUT}-specforge  # derived: rewritten whole on every run
sglang-hs convert $OUT --to specforge ${OUT}-specforge
