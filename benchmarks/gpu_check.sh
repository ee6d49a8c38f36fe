#!/usr/bin/env bash
# Every check that needs a CUDA GPU, as one prepared run: the flagship desks' scenarios on synthetic full-size
# releases (benchmarks/flagship.py: (a) Clef 27B int4 under a 24 GiB cap at 4K / 16K, (b) Clef 27B int8 on two
# simulated 24 GiB cards at 16K, (c) Clef-flash BF16 / int4 on the whole card, the gated delta net's two paths,
# the quantized kernels per layer, (d) the tests marked cuda). Prints one table, writes it to $OUT/flagship.md.
#   bash benchmarks/gpu_check.sh             # a CUDA machine: about 8 minutes on an H200, the builds included
#   bash benchmarks/gpu_check.sh --dry-run   # tiny shapes on the CPU, the whole script (tests/test_gpu_check.py)
# Resumable: each step's result is kept in $OUT/results; run the same command again after a cut and it goes on
# from there (BUDGET_S, default 420: no step starts after that many seconds; the rest say "not run").
# On this project's lent H200 (no network) packages missing there travel as wheels in .gpu/wheels (git-ignored):
# bitsandbytes, and for the fast gated-delta-net path flash-linear-attention, fla-core and einops.
# EXTRAS=1 adds the older checks after the table: GPTQ on CUDA and the joint head's speed (beyond the 8 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
DRY=""
if [ "${1:-}" = "--dry-run" ]; then DRY="--dry-run"; elif [ -n "${1:-}" ]; then
  echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2
fi
OUT=${OUT:-/tmp/clef-gpu-check}
WORK=${WORK:-/tmp/clef-flagship-work}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$WORK"
if [ -z "$DRY" ]; then
  if [ -d .gpu/wheels ] && [ -z "${NO_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
"$PY" -c "import torch, transformers, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'flash-linear-attention', bool(u.find_spec('fla')),
'bitsandbytes', bool(u.find_spec('bitsandbytes')))" | tee "$OUT/versions.txt"
"$PY" benchmarks/flagship.py --out "$OUT" --work "$WORK" --budget-s "${BUDGET_S:-420}" $DRY 2>&1 \
  | grep -v -e "^\[transformers\]" -e "^Loading weights" | tee -a "$OUT/log.txt"
status=${PIPESTATUS[0]}
if [ -n "${EXTRAS:-}" ] && [ -z "$DRY" ]; then
  echo "== quantize --calibrate (GPTQ) on CUDA: time and drift of the demo model's int8 variant"
  ( time clef-local quantize --bits 8 --calibrate --out "$OUT/demo-int8-gptq" --force ) 2>&1 \
    | grep -v "^\[transformers\]" | tail -12 | tee "$OUT/gptq_cuda.txt"
  echo "== joint schema head: ours vs the reference on CUDA"
  "$PY" benchmarks/head_speed.py --device cuda --repeats 5 2>&1 | grep -v "^\[transformers\]" \
    | tee "$OUT/head_speed_cuda.txt"
fi
exit "$status"
