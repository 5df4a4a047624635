#!/usr/bin/env bash
# benchmarks/mesh_sgd.py on one CUDA GPU: plain tensors (200 tensors, ~10M elements), fp32 and
# bf16, our SGD with jit_compile off ("distoptim") and on ("distoptim_jit"), against
# torch.optim.SGD foreach and fused and a plain copy. Budget: under 5 minutes in total (each
# dtype runs in its own process with its own time limit, so a slow torch.compile of one dtype
# cannot take the other's figures with it).
#
#   bash benchmarks/gpu.sh            # writes benchmarks/results/mesh_sgd_gpu_{fp32,bf16}.json
#
# Fails with exit code 2 and a clear message when no CUDA GPU is visible to torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "error: benchmarks/gpu.sh needs a CUDA GPU, but torch.cuda.is_available() is False" \
         "(torch $("$PY" -c 'import torch; print(torch.__version__)'), CUDA build:" \
         "$("$PY" -c 'import torch; print(torch.version.cuda)'))" >&2
    exit 2
fi
"$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__)'

status=0
for dtype in fp32 bf16; do
    echo "=== $dtype ==="
    # 140 s each: compile (first jit step) + 3 optimizers x (10 warm-up + 100 timed steps).
    if ! timeout 140 "$PY" benchmarks/mesh_sgd.py --device cuda --dtypes "$dtype" \
            --no-dtensor --reps 100 --warmup 10 \
            --out "benchmarks/results/mesh_sgd_gpu_${dtype}.json"; then
        echo "error: the $dtype run failed or passed its 140 s limit" >&2
        status=1
    fi
done
exit $status
