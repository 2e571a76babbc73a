#!/usr/bin/env bash
# speculators 0.9.0 trains online from a live sglang-hs server: each dataset row's states are
# asked of the server when the trainer reads the row, handed over as a file the trainer deletes
# (BACKEND=file, fp8) or as a Mooncake object (BACKEND=mooncake). Nothing is kept on disk.
set -euo pipefail
MODEL=${MODEL:?the target checkpoint (HF layout)}
DATA=${DATA:?records, as for sglang-hs capture}
WORK=${WORK:-/dev/shm/online-speculators}
BACKEND=${BACKEND:-file}
PORT=${PORT:-30000}
MASTER=${MASTER:-127.0.0.1:50051}   # mooncake_master, BACKEND=mooncake only
TRAIN_ARGS=${TRAIN_ARGS:-}          # more speculators flags (--epochs, --save-path, ...)
LAUNCH=${LAUNCH:-python -m sglang.launch_server}  # on a machine without a GPU: sglang-hs serve-cpu
ATTENTION=${ATTENTION:-triton}                    # without a GPU: torch_native
mkdir -p $WORK

# 1. The server, stock launcher plus our flags; its model name is what speculators checks
#    (--served-model-name, default --model-path).
case $BACKEND in
    file|fp8) SINK="--export-sink speculators-$BACKEND" ;;
    mooncake) SINK="--export-sink speculators-mooncake --export-mooncake-master $MASTER"
              pgrep -x mooncake_master > /dev/null || { mooncake_master --rpc_address=${MASTER%:*} \
                  --rpc_port=${MASTER#*:} > $WORK/master.log 2>&1 & }
              until (exec 3<>/dev/tcp/${MASTER%:*}/${MASTER#*:}) 2>/dev/null; do sleep 0.5; done ;;
esac
$LAUNCH --model-path $MODEL --port $PORT --attention-backend $ATTENTION --sampling-backend pytorch \
    --export-hidden-states-dir $WORK/hs $SINK > $WORK/server.log 2>&1 &
SERVER=$!
trap 'kill $SERVER' EXIT
until curl -sf localhost:$PORT/health > /dev/null; do
    kill -0 $SERVER 2>/dev/null || { echo "server exited; see $WORK/server.log" >&2; tail -n 30 $WORK/server.log >&2; exit 1; }
    sleep 5
done

# 2. speculators' dataset index from the records (tokenization and masks as capture's), no states.
rm -rf $WORK/index  # derived: rewritten whole on every run
sglang-hs index --to speculators --data $DATA --model $MODEL $WORK/index

# 3. Train. Each row's states come from the server as the row is read.
MOONCAKE=""
[ $BACKEND = mooncake ] && MOONCAKE="--mooncake-master $MASTER --mooncake-protocol tcp"
python -m speculators.train --data-path $WORK/index --verifier-name-or-path $MODEL \
    --vllm-endpoint http://127.0.0.1:$PORT/v1 --hidden-states-backend $BACKEND $MOONCAKE \
    --draft-vocab-size 32000 $TRAIN_ARGS
