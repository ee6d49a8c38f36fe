#!/usr/bin/env bash
# Build and measure the demo model (clef-demo-135m) on a CUDA machine: convert the GGUF backbone, train the joint
# schema head with train-head's default recipe (the shipped head's; the same command runs on CPU, slower), and
# evaluate it on BANKING77 and NLU++. Writes the head and the metrics under $OUT. BANKING77, NLUPP, TWINS, EPOCHS
# (unset: train-head's defaults) and TRAIN_ARGS scale it down for a quick dry run on CPU:
#   NO_WHEELS=1 DEVICE=cpu BANKING77=20 NLUPP=10 TWINS=8 EPOCHS=1 LIMIT=5 TRAIN_ARGS="--canonical 20" \
#     bash scripts/train_demo_gpu.sh
# ADAPTERS=1 also trains the v2 recipe: LoRA adapters on the backbone with a whole-record head
# (train-head --adapters, clef_local/training/adapter_train.py) on RECORDS decision records, started from the head
# in INIT (a head directory, e.g. clef_local/demo/head; default: a fresh head), merged into a copy of the backbone
# and evaluated on every section (ADAPTER_ARGS: more train-head --adapters options, e.g. "--lr 1e-3 --max-steps 500"):
#   ADAPTERS=1 RECORDS=40000 ADAPTER_SPEC=r=16,alpha=32,layers=30 bash scripts/train_demo_gpu.sh
# On the lent H200 (no network, 64 MiB carried per call): the GGUF travels in two parts. A call's carried paths
# replace .gpu/ in the repo copy, but /tmp survives while the machine is warm (30 s), so call 1 carries
# .gpu/gguf.part-01 and runs `mkdir -p /tmp/clef-gguf && cp .gpu/gguf.part-01 /tmp/clef-gguf/`; call 2 carries
# .gpu/wheels .gpu/gguf.part-00 .gpu/gguf.sha256 and runs this script (BANKING77 / NLU++ ship in clef_local/data).
# Measured 2026-11-30 on the H200: conversion + the default recipe of then (the full method since removed: cache,
# 8 epochs, full evaluation) took ~5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/clef-demo-build}; DEVICE=${DEVICE:-cuda}; WORK=${WORK:-/tmp/clef-demo-work}
BANKING77=${BANKING77:-}; NLUPP=${NLUPP:-}; TWINS=${TWINS:-}; EPOCHS=${EPOCHS:-}; LIMIT=${LIMIT:-}
# TRAIN_ARGS: extra train-head options of the default recipe, e.g. TRAIN_ARGS="--width 512 --feedforward 1024"
# (`python3 -m clef_local.cli train-head --help` lists them, each with the reason for its default)
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/log.txt") 2>&1  # the log comes back even when the call is stopped at its time limit
if [ -d .gpu/wheels ] && [ -z "${NO_WHEELS:-}" ]; then  # NO_WHEELS=1: a local dry run
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
GGUF="$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f .gpu/gguf.sha256 ]; then
  parts=()
  for n in 00 01 02 03; do
    for dir in .gpu /tmp/clef-gguf; do
      if [ -f "$dir/gguf.part-$n" ]; then parts+=("$dir/gguf.part-$n"); break; fi
    done
  done
  cat "${parts[@]}" > "$GGUF"
  echo "$(cat .gpu/gguf.sha256)  $GGUF" | sha256sum -c -
else
  GGUF=$(python3 -c "from clef_local.demo.backbone import find_gguf; print(find_gguf())")
fi
[ -f "$WORK/backbone/model.safetensors" ] || python3 -c "
import sys, logging; from pathlib import Path
logging.basicConfig(level=logging.INFO)
from clef_local.demo.backbone import convert_backbone
print(convert_backbone(Path(sys.argv[1]), Path(sys.argv[2])))" "$GGUF" "$WORK/backbone"
sha256sum "$WORK/backbone/model.safetensors" | tee "$OUT/backbone.sha256"

train_and_eval() {  # name [train-head options of this recipe]
  local name=$1
  python3 -m clef_local.cli train-head --backbone "$WORK/backbone" --out "$OUT/$name" --work "$WORK/$name.work" \
    --device "$DEVICE" ${BANKING77:+--banking77 "$BANKING77"} ${NLUPP:+--nlupp "$NLUPP"} ${TWINS:+--twins "$TWINS"} \
    ${EPOCHS:+--epochs "$EPOCHS"} ${2:-} ${TRAIN_ARGS:-} 2>&1 | grep -v "it/s]$" | tail -20
  rm -rf "$WORK/$name.release" && cp -r "$WORK/backbone" "$WORK/$name.release"
  cp "$OUT/$name"/joint_head.safetensors "$OUT/$name"/joint_head_config.json "$WORK/$name.release/"
  python3 benchmarks/demo_model.py --model "$WORK/$name.release" --device "$DEVICE" ${LIMIT:+--limit $LIMIT} \
    --sections banking77 nlupp robustness --json "$OUT/$name/metrics.json" 2>&1 | grep -v "^\[transformers\]"
}
train_adapters_and_eval() {  # the v2 recipe: adapters + a whole-record head, merged, every section measured
  local name=adapters
  python3 -m clef_local.cli -v train-head --adapters "${ADAPTER_SPEC:-r=16,alpha=32,layers=10}" \
    --records "${RECORDS:-20000}" --backbone "$WORK/backbone" ${INIT:+--init "$INIT"} \
    --out "$OUT/$name" --work "$WORK/$name.work" --device "$DEVICE" ${ADAPTER_ARGS:-} 2>&1 | tail -20
  rm -rf "$WORK/$name.release" && cp -r "$WORK/backbone" "$WORK/$name.release"
  cp "$OUT/$name"/joint_head.safetensors "$OUT/$name"/joint_head_config.json "$WORK/$name.release/"
  python3 -c "import sys; from pathlib import Path; from clef_local.demo.adapter import merge_adapter
merge_adapter(Path(sys.argv[1]) / 'model.safetensors', Path(sys.argv[2]) / 'backbone_adapter.safetensors')" \
    "$WORK/$name.release" "$OUT/$name"
  python3 benchmarks/demo_model.py --model "$WORK/$name.release" --device "$DEVICE" ${LIMIT:+--limit $LIMIT} \
    --sections banking77 nlupp robustness ordinal negation --json "$OUT/$name/metrics.json" 2>&1 \
    | grep -v "^\[transformers\]"
}
if [ -n "${ADAPTERS:-}" ]; then echo "== adapters (v2) recipe"; train_adapters_and_eval; fi
echo "== default recipe"; train_and_eval default
if [ -n "${LARGE:-}" ]; then
  # more of every source; 8 epochs: a state-only prototype's 77-way top-1 was still rising at epoch 8
  echo "== larger recipe"; train_and_eval large "--banking77 10240 --nlupp 3328 --twins 2048 --epochs 8"
fi
