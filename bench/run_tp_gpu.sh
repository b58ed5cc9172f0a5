#!/usr/bin/env bash
# Runs on a GPU machine with two or more GPUs over the files scripts/gpu-stage-tp put in .gpu/:
# the NCCL tensor-parallel tests, example 07 (two ranks, a GPU each) and the vote benchmark. Logs
# go to $OUT (default out/gpu, git-ignored). libnccl is taken from the machine: the CUDA
# toolkit's lib/ or the nvidia-nccl Python package. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
#   bash bench/run_tp_gpu.sh [tests] [example] [bench]   (default: all three)
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
nccl_py=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/.gpu/lib:/usr/local/cuda/lib:/usr/local/cuda/lib64:${nccl_py}:${LD_LIBRARY_PATH:-}"
bash scripts/gpu-unpack .gpu  # (libkvq.so travels compressed: scripts/gpu-stage)
steps=${*:-tests example bench}
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/tp_gpu.txt"
nvidia-smi topo -m >> "$OUT/tp_gpu.txt" 2>&1
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/tp_gpu.txt"
rc=0
for s in $steps; do
  case $s in
    tests)
      ./.gpu/kvq_tp_nccl_tests 2>&1 | tee "$OUT/tp_tests.log" | tail -20; rc=$((rc | ${PIPESTATUS[0]})) ;;
    example)
      ./.gpu/kvq_example_tensor_parallel_echokv 2>&1 | tee "$OUT/tp_example.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    bench)
      ./.gpu/kvq_bench_tp_vote_cuda --batches 1,8,64 --context 8192 2>&1 | tee "$OUT/tp_vote.log"
      rc=$((rc | ${PIPESTATUS[0]})) ;;
    *) echo "unknown step $s" >&2; rc=2 ;;
  esac
done
exit $rc
