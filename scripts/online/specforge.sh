#!/usr/bin/env bash
# SpecForge 0.2.0 trains online from a live sglang-hs server: its producer sends the prompts
# (with `spec_capture`), the server writes each sample into Mooncake, its consumer trains on
# them and frees them. Nothing is kept on disk.
set -euo pipefail
MODEL=${MODEL:?the target checkpoint (HF layout)}
DATA=${DATA:?records, as for sglang-hs capture}
WORK=${WORK:-/dev/shm/online-specforge}
PORT=${PORT:-30000}
MASTER=${MASTER:-127.0.0.1:50051}
TRAIN_ARGS=${TRAIN_ARGS:-}          # dotted overrides (training.num_epochs=2 ...)
LAUNCH=${LAUNCH:-python -m sglang.launch_server}  # on a machine without a GPU: sglang-hs serve-cpu
ATTENTION=${ATTENTION:-triton}                    # without a GPU: torch_native
mkdir -p $WORK

# 1. The store, then the server writing SpecForge's layout into it.
#    Chunked prefill and the prefix cache stay on.
pgrep -x mooncake_master > /dev/null || { mooncake_master --rpc_address=${MASTER%:*} --rpc_port=${MASTER#*:} \
    > $WORK/master.log 2>&1 & }
until (exec 3<>/dev/tcp/${MASTER%:*}/${MASTER#*:}) 2>/dev/null; do sleep 0.5; done  # listening
$LAUNCH --model-path $MODEL --port $PORT --attention-backend $ATTENTION --sampling-backend pytorch \
    --export-hidden-states-dir $WORK/hs --export-sink specforge --export-mooncake-master $MASTER \
    > $WORK/server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:$PORT/health > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see $WORK/server.log" >&2; tail -n 30 $WORK/server.log >&2; exit 1; }
    sleep 5
done

# 2. SpecForge's prompts (pre-tokenized as capture does), draft config, vocabulary mapping and
#    run config, pointed at this server and store.
rm -rf $WORK/sf  # derived: rewritten whole on every run
sglang-hs index --to specforge --data $DATA --model $MODEL $WORK/sf \
    --server http://127.0.0.1:$PORT --mooncake-master $MASTER

# 3. Train: SpecForge's launcher starts its producer and consumer roles.
specforge train -c $WORK/sf/specforge.yaml $TRAIN_ARGS
