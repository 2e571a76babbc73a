#!/usr/bin/env bash
# Kimi-K2.5 INT4 (61 layers, MLA + MoE), TP8 on 8x RTX PRO 6000 Blackwell (SM120) over PCIe.
# Aux layers match the seed's [3, 31, 59] in the HF output_hidden_states convention (index k =
# input of decoder layer k). Only TP rank 0 copies rows off the GPU and writes; /dev/shm keeps
# the writer off the disks (56 KiB per token: 3 aux + final planes x hidden 7168 x 2 bytes, bf16).
# Not run by us at this size: written from the flags we tested on one H200 and the SM120 notes.
# The same architecture (DeepseekV3ForCausalLM: MLA + MoE) in miniature is exported and checked
# against HF transformers on CPU by test/server/test_deepseek_cpu.py.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-K2.5}
OUT=${OUT:-/dev/shm/hs-kimi-k25}
DATA=${DATA:-chats.jsonl}

python -m sglang.launch_server --model-path $MODEL --trust-remote-code --tp-size 8 --port 30000 \
    --attention-backend triton \
    --export-hidden-states-dir $OUT --export-aux-layer-ids 3 31 59 \
    --export-host-buffer-gib 4 --skip-server-warmup > server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:30000/health > /dev/null; do sleep 10; done

# Kimi's chat template comes from the checkpoint (trust_remote_code tokenizer); masks cover the
# assistant turns; --mask-reasoning zeroes <think> spans if you train a non-thinking drafter.
sglang-hs capture --server http://127.0.0.1:30000 --data $DATA --out $OUT --concurrency 128 --max-length 8192
sglang-hs inspect $OUT
sglang-hs convert $OUT --to specforge ${OUT}-specforge
