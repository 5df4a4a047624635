#!/usr/bin/env bash
# Every GPU figure in one short run on one CUDA GPU, each part under its own time limit so a slow
# part cannot take the others' figures with it (about 10 minutes in all):
#
#   1. benchmarks/gpu_mesh_sgd.py   -- distoptim.dtensor.SGD's single-pass Nesterov against
#      torch.optim.SGD fused and foreach, fp32 and bf16, ~100M elements: correctness against a
#      float64 replay of Keras' rule, then interleaved step times and paired ratios;
#   2. benchmarks/gpu_cross_shard.py -- the local update cost of CrossShardOptimizer with and
#      without weight-update sharding against plain Adam, DDP and ZeroRedundancyOptimizer, world 1
#      (NCCL), fp32 and bf16;
#   3. benchmarks/gpu_fsdp_diloco.py -- examples/fsdp_diloco_torchrun.py on NCCL: DiLoCo across
#      2 replica groups of 2 FSDP2 processes (one device each, torchft's ProcessGroupNCCL across
#      the groups), every process's model checksum checked equal; it needs 4 devices and torchft,
#      and says so (skipped, exit 0) without them.
#
#   bash benchmarks/gpu.sh [OUTDIR]   # JSON to OUTDIR (default benchmarks/results)
#
# Runs from the source tree (PYTHONPATH=src), so it needs only torch and numpy where it runs.
# Fails with exit code 2 and a clear message when no CUDA GPU is visible to torch; exit 1 when a
# part failed or passed its limit (the other parts still run and write their figures).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUTDIR="${1:-benchmarks/results}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: benchmarks/gpu.sh needs a CUDA GPU, but torch.cuda.is_available() is False" \
         "(torch $("$PY" -c 'import torch; print(torch.__version__)'), CUDA build:" \
         "$("$PY" -c 'import torch; print(torch.version.cuda)'))" >&2
    exit 2
fi
"$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,temperature.gpu --format=csv || true

status=0
run() {  # run LIMIT NAME CMD...: one part, killed 20 s after its own time limit
    local limit=$1 name=$2
    shift 2
    echo "=== $name ==="
    if ! timeout "$((limit + 20))" "$@"; then
        echo "error: $name failed or passed its ${limit} s limit" >&2
        status=1
    fi
}
run 150 gpu_mesh_sgd "$PY" benchmarks/gpu_mesh_sgd.py --out "$OUTDIR/gpu_mesh_sgd.json" \
    --dtypes fp32,bf16 --time-limit 150
run 150 gpu_cross_shard "$PY" benchmarks/gpu_cross_shard.py --out "$OUTDIR/cross_shard_gpu.json" \
    --dtypes fp32 bf16 --time-limit 150
run 240 gpu_fsdp_diloco "$PY" benchmarks/gpu_fsdp_diloco.py --out "$OUTDIR/gpu_fsdp_diloco.json" \
    --time-limit 240
exit $status
