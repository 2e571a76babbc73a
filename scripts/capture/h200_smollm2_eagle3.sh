#!/usr/bin/env bash
# One H200, end to end: SmolLM2-135M-Instruct served the cheap way (fp8, triton attention,
# CUDA graphs on) writes its own responses and exports its own states; SpecForge 0.2.0 trains a
# one-layer EAGLE-3 drafter on them; SGLang serves the target with that drafter.
# benchmark/e2e_eagle3.py runs the same steps as a measured experiment (plus the HF-states control).
set -euo pipefail
MODEL=${MODEL:-.cache/models/smollm2-135m-instruct}   # models.smollm2() writes it from the GGUF
WORK=${WORK:-/dev/shm/e2e}
PROMPTS=${PROMPTS:-prompts.jsonl}   # {"messages": [{"role": "user", ...}, {"role": "assistant", "content": ""}]}
SERVE="--attention-backend triton --sampling-backend pytorch --quantization fp8"

# 1. Serve with export on. The server that will serve the drafter is the one that exports.
python -m sglang.launch_server --model-path $MODEL --port 30000 $SERVE \
    --export-hidden-states-dir $WORK/export --skip-server-warmup > $WORK-server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:30000/health > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see $WORK-server.log" >&2; exit 1; }
    sleep 5
done

# 2. The target writes every assistant turn (greedy), then the whole chat is exported.
sglang-hs capture --server http://127.0.0.1:30000 --data $PROMPTS --out $WORK/export \
    --regenerate --max-new-tokens 256 --concurrency 64
kill $SERVER; wait $SERVER 2>/dev/null || true
trap - EXIT

# 3. SpecForge's layout, and its trainer. `convert` also writes the draft config both ends read:
#    one Llama layer of the target's geometry, its lm_head untied (a tied one is dropped by
#    SGLang without a word) and the aux layers in SGLang's numbering (the HF ids minus one).
rm -rf $WORK/sf  # derived: rewritten whole on every run
sglang-hs convert $WORK/export --to specforge $WORK/sf
specforge train --config $WORK/sf/specforge.yaml training.fsdp_sharding=NO_SHARD \
    training.num_epochs=2 output_dir=$WORK/train

# 4. A draft folder SGLang loads.
python -m specforge.export.to_sglang --checkpoint $WORK/train \
    --draft-config $WORK/sf/draft_config.json --output-dir $WORK/draft

# 5. Serve the target with its drafter; each response's meta_info.spec_accept_length is the
#    acceptance length.
python -m sglang.launch_server --model-path $MODEL --port 30000 $SERVE \
    --speculative-algorithm EAGLE3 --speculative-draft-model-path $WORK/draft \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
