#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device (CI has none):
#   bash tests/gpu/device_check.sh [bench systems] [bench steps]
# 1. the tests marked gpu (tests/gpu: stages 0-3 x fp32/bf16/fp16 x accumulation x SGD/AdamW,
#    offload, checkpoints, activation checkpointing), 2. the 110M GPT-2 bench on one device.
# The pipeline and expert benches (bench/pipeline_vs_deepspeed.py, bench/moe_dispatch.py) need a
# rank per device and at least two ranks (NCCL gives each rank its own GPU), so they are not
# part of this one-GPU script. On GPUs the launcher's --allocator auto keeps glibc's malloc.
# Logs go to $OUT (default /tmp/zerotrain-gpu). Wheels in .whl/ (packages the machine lacks,
# e.g. pydantic) are installed to /tmp/site first; a deepspeed package folder in .dspkg/ adds
# the DeepSpeed systems to the bench. Both are prepared here and ignored by git, e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl pydantic==2.13.4 pydantic_core==2.46.4 \
#       annotated-types==0.8.0 typing-inspection==0.4.2 hjson==3.1.0
#   cp -r /work/dsvenv/lib/python3.11/site-packages/deepspeed .dspkg/
# and travel with the device tool's carry (".whl", ".dspkg").
set -u
OUT=${OUT:-/tmp/zerotrain-gpu}
mkdir -p "$OUT"
SYSTEMS=${1:-ddp,zt0,zt1,zt2,zt3,zt3_bf16,fsdp2,ds0,ds1,ds2,ds3}
STEPS=${2:-12}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
DS=()
if [ -d .dspkg/deepspeed ]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.dspkg"
  DS=(--deepspeed-python python3)
fi
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, pydantic; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'transformers', transformers.__version__, \
'pydantic', pydantic.VERSION, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest tests/gpu -m gpu -v -p no:cacheprovider --timeout 300 \
  -o addopts="-ra" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | tail -20
grep -E "^E  " "$OUT/gpu_tests.log" | head -40
timeout ${BENCH_TIMEOUT:-360} python3 bench/gpt2_110m.py --device cuda --nproc 1 --model 110m --systems "$SYSTEMS" \
  --steps "$STEPS" "${DS[@]}" --json "$OUT/bench_110m.json" > "$OUT/bench_110m.log" 2>&1
echo "bench exit $?"
grep -v "^  File\|^    " "$OUT/bench_110m.log" | tail -40
