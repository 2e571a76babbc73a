#!/usr/bin/env bash
# One device call on the GPU host (no network): unpack the offline SGLang 0.5.17 bundle, install
# this checkout's wheel next to it, prove the plugin is discoverable, then run the given steps.
#   benchmark/gpu_session.sh tests families int4 baselines   (or: radix-on radix-off fp8 e2e)
# Needs .gpu/sglang0517-site.tar.xz (../shared/gpu-bundle/build.sh .gpu), .gpu/sglang_hs-*.whl
# (pip wheel --no-deps -w .gpu .) and, for `families`, .gpu/tok (the SmolLM2 tokenizer files:
# tokenizer.json, tokenizer_config.json, chat_template.jinja), all carried.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/sgl-site
if [ ! -d $SITE/sglang ]; then
  python3 -c "import tarfile;tarfile.open('.gpu/sglang0517-site.tar.xz').extractall('$SITE',filter='data')"
fi
python3 -m pip install -q --no-deps --no-index --upgrade --target $SITE .gpu/sglang_hs-*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=$SITE SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1
python3 -c "from importlib.metadata import entry_points as e; assert 'sglang_hs' in [x.name for x in e(group='sglang.srt.plugins')]" || exit 3
export SGLANG_HS_LOGS=/tmp/hs-logs SGLANG_HS_TOKENIZER=$PWD/.gpu/tok; mkdir -p $SGLANG_HS_LOGS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# STEP_TIMEOUT=S bounds each step (0: none), so a step cut short still has its logs packed below.
T="timeout ${STEP_TIMEOUT:-0}"
for step in "$@"; do
  case $step in
    tests) SGLANG_HS_GPU_RESULTS=$OUT/gpu_tests.json $T python3 -m pytest -v -rs -m gpu test/gpu/test_export_gpu.py \
             test/gpu/test_tp2_export.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.txt" ;;
    int4) SGLANG_HS_GPU_RESULTS=$OUT/gpu_int4.json $T python3 -m pytest -v -rs -s -m gpu test/gpu/test_int4_gpu.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_int4.txt" ;;
    families) SGLANG_HS_GPU_RESULTS=$OUT/gpu_families.json $T python3 -m pytest -v -rs -m gpu test/gpu/test_families_gpu.py \
             -p no:cacheprovider 2>&1 | tee "$OUT/gpu_families.txt" ;;
    # E2E_ARGS: benchmark/e2e_eagle3.py's flags; .gpu/trainers.tgz: SpecForge 0.2.0 + accelerate
    e2e) TR=/tmp/sgl-trainers; [ -d $TR/specforge ] || { mkdir -p $TR && tar xzf .gpu/trainers.tgz -C $TR; }
         SGLANG_HS_TRAINERS=$TR PYTHONPATH=$SITE:$TR:$PWD $T python3 benchmark/e2e_eagle3.py --work ${E2E_WORK:-/tmp/e2e} \
           --out "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 | tee -a "$OUT/e2e.txt"
         (cd ${E2E_WORK:-/tmp/e2e} && tar czf "$OUT/e2e-logs.tgz" $(find . -maxdepth 1 -name '*.log')) ;;
    *) $T python3 benchmark/bench_gpu_export.py --phase "$step" --rounds "${ROUNDS:-2}" --out "$OUT/bench_gpu.json" \
         --work $SGLANG_HS_LOGS 2>&1 | tee -a "$OUT/bench_gpu.txt" ;;
  esac
  # server logs only (checkpoints and exports there are too big to come back; at most 8 files do)
  (cd $SGLANG_HS_LOGS && tar czf "$OUT/logs.tgz" $(find . -maxdepth 1 -name '*.log'))
done
