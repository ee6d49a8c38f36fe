#!/usr/bin/env bash
# Every check in this repository that needs a CUDA GPU, as one prepared run (prints tables; not part of CI).
#   bash benchmarks/gpu_check.sh            # on any machine with CUDA, torch and the project's dependencies
# On this project's lent H200, packages missing there travel as wheels in .gpu/wheels (git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/clef-gpu-check}
mkdir -p "$OUT"
if [ -d .gpu/wheels ] && [ -z "${NO_WHEELS:-}" ]; then  # NO_WHEELS=1: a local dry run
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

echo "== runtime on CUDA vs CPU (tests marked cuda)"
python3 -m pytest -q -s -m cuda tests/ -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log"
echo "== quantize --calibrate (GPTQ) on CUDA: time and drift of the demo model's int8 variant"
( time clef-local quantize --bits 8 --calibrate --out "$OUT/demo-int8-gptq" --force ) 2>&1 | grep -v "^\[transformers\]" \
  | tail -12 | tee "$OUT/gptq_cuda.txt"
echo "== joint schema head: ours vs the reference on CUDA"
python3 benchmarks/head_speed.py --device cuda --repeats 5 2>&1 | grep -v "^\[transformers\]" | tee "$OUT/head_speed_cuda.txt"
