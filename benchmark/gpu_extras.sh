#!/usr/bin/env bash
# Builds what `gpu_session.sh online` needs besides the SGLang bundle, for the GPU host's cp312
# (no network there): the trainers' online dependencies as .gpu/parts-a|b/online-extras.tar.xz.part-*
# (each folder under one call's 64 MiB carry), Mooncake's three Debian libraries as .gpu/libs.tgz,
# and SmolLM2's tokenizer files in .gpu/tok. Run with the project's venv built (make venv).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu T=$(mktemp -d)
trap 'rm -rf $T' EXIT
C=constraints/sglang-0.5.17.txt
pin() { grep -i "^$1==" $C || { echo "no pin for $1 in $C" >&2; exit 1; }; }
# The runtime's own versions where 0.5.17 pins them; the trainers' and Mooncake's as the Makefile does.
specs="$(for p in datasets pyarrow pandas multiprocess xxhash fsspec dill accelerate python-dateutil tzdata; do pin $p; done)
pytz==2025.2 six==1.17.0 specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
pydantic-settings==2.16.3 python-dotenv==1.2.4 mooncake-transfer-engine-non-cuda==0.3.13.post1"
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d $T/whl $specs
mkdir -p $T/site && for w in $T/whl/*.whl; do unzip -q -o $w -d $T/site; done
rm -rf $G/parts-a $G/parts-b && mkdir -p $G/parts-a $G/parts-b
tar -cJf $T/online-extras.tar.xz -C $T/site .
split -b 42M -a 2 $T/online-extras.tar.xz $T/online-extras.tar.xz.part-
mv $T/online-extras.tar.xz.part-aa $G/parts-a/ && mv $T/online-extras.tar.xz.part-* $G/parts-b/
libs=$(for p in libibverbs1 libnl-3-200 libnl-route-3-200; do dpkg -L $p | grep '\.so'; done)
tar czhf $G/libs.tgz --transform 's,.*/,,' $libs
mkdir -p $G/tok && m=$(.venv/bin/python -c "from sglang_hs.tools.models import smollm2; print(smollm2('$T/smollm2'))")
cp $m/tokenizer.json $m/tokenizer_config.json $G/tok/ && { cp $m/chat_template.jinja $G/tok/ 2>/dev/null || true; }
du -sh $G/parts-* $G/libs.tgz $G/tok
