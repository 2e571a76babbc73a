#!/usr/bin/env bash
# Kimi-K2.5 INT4 (61 layers, MLA + MoE), TP8 on 8x RTX PRO 6000 Blackwell (SM120) over PCIe.
# Aux layers match the seed's [3, 31, 59] in the HF output_hidden_states convention (index k =
# input of decoder layer k). Only TP rank 0 copies rows off the GPU and writes; /dev/shm keeps
# the writer off the disks (56 KiB per token: 3 aux + final planes x hidden 7168 x 2 bytes, bf16).
# Not run by us at this size (no 8-GPU machine). test/server/test_recipes_cpu.py runs this very
# script in miniature: a tiny checkpoint of the same class (KimiK25ForConditionalGeneration,
# text weights under language_model.), TP2 in CPU mode, the bundled chats; it starts, captures,
# converts and the export matches HF. The variables below are what that test changes.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-K2.5}
OUT=${OUT:-/dev/shm/hs-kimi-k25}
DATA=${DATA:-chats.jsonl}
TP=${TP:-8}
AUX=${AUX:-3 31 59}
PORT=${PORT:-30000}
LAUNCH=${LAUNCH:-python -m sglang.launch_server}  # the test: sglang-hs serve-cpu
ATTENTION=${ATTENTION:-triton}                    # the test: torch_native (CPU)
LOG=${LOG:-server.log}

$LAUNCH --model-path $MODEL --trust-remote-code --tp-size $TP --port $PORT \
    --attention-backend $ATTENTION \
    --export-hidden-states-dir $OUT --export-aux-layer-ids $AUX \
    --export-host-buffer-gib 4 --skip-server-warmup > $LOG 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf localhost:$PORT/health > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see $LOG" >&2; tail -n 30 $LOG >&2; exit 1; }
    sleep 5
done

# Kimi's tokenizer and chat template come from the checkpoint (remote code); masks cover the
# assistant turns; --mask-reasoning zeroes <think> spans if you train a non-thinking drafter.
sglang-hs capture --server http://127.0.0.1:$PORT --data $DATA --out $OUT --trust-remote-code \
    --concurrency 128 --max-length 8192
sglang-hs inspect $OUT
rm -rf ${OUT}-specforge  # derived: rewritten whole on every run
sglang-hs convert $OUT --to specforge ${OUT}-specforge --trust-remote-code
