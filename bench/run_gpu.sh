#!/usr/bin/env bash
# Runs on the GPU machine over the files scripts/gpu-stage put in .gpu/: GPU tests, compute-
# sanitizer (memcheck + racecheck on reduced sizes), the decode benchmark and the FP16 peer, in
# one session so that ratios compare like with like. Logs and raw results go to $OUT (default
# out/gpu, git-ignored).
#   bash bench/run_gpu.sh [tests] [sanitize] [examples] [bench] [peer] [shapes] [canary] [prefill] [ab] [serve] [replay]
#                         [step] [window] [python] [flashinfer]
#   (default: tests sanitize bench peer)
# examples: the examples that run the CUDA backend or the low-level CUDA API (examples.log).
# ab: the decode benchmark of another build (KVQ_AB_BASE, default out/gpu-base/, staged the same
# way from the commit to compare against) and of KVQ_AB_NEW (default .gpu/), KVQ_AB_ROUNDS (default 2) rounds each,
# interleaved (KVQ_AB_FILTER: a --benchmark_filter); ab.md is bench/ab_compare.py's table,
# ab_json.tar.gz the raw results.
# shapes: the decode benchmark over other models' attention shapes (head_dim 64/128/256, GQA 1-8;
# bench/decode_cuda.cpp `model_shapes`) and the peer with each model's heads; report_shapes.py's
# shapes.md / shapes.svg / shapes.csv (exit 1 when a goal is missed).
# prefill: a 32K prompt in 8 chunks of 4K through KVCache::prefill (fp16, kivi4/g32) and the BF16
# SDPA peer (bench/peer_prefill.py) over the same chunks; prints kvq / peer time ratios (prefill.md;
# the target: at most 1.5); the "prefix" rows time the prefill's prefix part alone (attend_prefix).
# canary: EchoKV's device-canary overhead on a Llama-8B-like decode step (canary.log, canary.json).
# serve: the end-to-end serving benchmark (bench/serve/README.md): a 2-layer smoke run, then the
# Llama-3-8B-shaped run over every backend (KVQ_SERVE_BACKENDS: its --backends list, space-separated;
# KVQ_SERVE_ARGS: more serve.py options); serve.json, steps.csv, serve.log, and report_serve.py's
# serve.md, serve.svg, serve.png.
# step: an eager decode step's host, device and wall time with value checks on and off (step.csv;
# KVQ_STEP_ARGS: its options, bench/step_cuda.cpp).
# window: the sliding-window decode rows (a 4096-token window over 8 x 32K) and the 8 x 4K and
# 8 x 32K rows of the same formats (KVQ_WINDOW_FORMATS, default kivi4/g32;kivi2/g32;sym8;fp8;fp16);
# report_decode.py's window table (window.md: each window row over its 8 x 4K row; goal 1.10).
# python: the Python package's tests (pytest python/tests, the GPU-marked ones included) over the
# package scripts/gpu-stage put in .gpu/python (python.log).
# flashinfer: the quantized peer (issue 48): FlashInfer's paged decode over BF16 and FP8 caches and
# its paged prefill (bench/peer_flashinfer.py), with kvq's decode rows of the same formats and the
# BF16 peer in the same call (fi_kvq.json, fi_peer.csv, peer_flashinfer.csv, peer_flashinfer_prefill.csv,
# decode_fi.md: report_decode.py --flashinfer). FlashInfer must be installed on the machine first
# (bench/stage_flashinfer.sh device ..., an earlier call on the same held machine: FI_SITE, default
# /tmp/fi-site); its JIT cache is FLASHINFER_WORKSPACE_BASE (default /tmp/fi-ws).
# replay: a decode step replayed from one CUDA graph (decode_step) against its eager calls, on a
# Llama-8B-like stack at batch 1 / 8 / 32 and contexts 1K / 32K (replay.log).
set -uo pipefail
OUT=${OUT:-$PWD/out/gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
# (libkvq.so travels compressed: scripts/gpu-stage)
bash scripts/gpu-unpack .gpu ${KVQ_AB_BASE:-out/gpu-base} ${KVQ_AB_NEW:-}
steps=${*:-tests sanitize bench peer}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
date -u +%Y-%m-%dT%H:%MZ >> "$OUT/gpu.txt"
rc=0
for s in $steps; do
  case $s in
    tests)
      ./.gpu/kvq_cuda_tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -20; rc=$((rc | ${PIPESTATUS[0]})) ;;
    sanitize)
      cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      KVQ_GPU_TEST_SMALL=1 "$cs" --tool memcheck --error-exitcode 3 ./.gpu/kvq_cuda_tests "[decode],[extend],[errors]" \
        > "$OUT/memcheck.log" 2>&1; r=$?; tail -4 "$OUT/memcheck.log"; rc=$((rc | r))
      for f in "[append]" "[canary]" "[graph]" "[fork],[truncate]" "[rotation]" "gpu: a launch failing*" "[windows]" \
               "[prefill]" "[contract]" "[variants]"; do  # appended to memcheck.log (the device returns at most 8 files)
        KVQ_GPU_TEST_SMALL=1 "$cs" --tool memcheck --error-exitcode 3 ./.gpu/kvq_cuda_tests "$f" \
          > "$OUT/memcheck_one.log" 2>&1; r=$?; echo "memcheck $f: $(tail -1 "$OUT/memcheck_one.log")" | tee -a "$OUT/memcheck.log"
        rm -f "$OUT/memcheck_one.log"; rc=$((rc | r))
      done
      # (no racecheck of [canary]: its 512-thread blocks make racecheck take many minutes)
      KVQ_GPU_TEST_SMALL=1 "$cs" --tool racecheck --error-exitcode 3 ./.gpu/kvq_cuda_tests "gpu: mixed formats*" \
        > "$OUT/racecheck.log" 2>&1; r=$?; tail -3 "$OUT/racecheck.log"; rc=$((rc | r))
      # [lowlevel]: both staged kernels (hints 8, 4, 2), page_tokens 64 and 128; long sequences:
      # every page stage refilled several times (8-bit rings with two full barriers per stage);
      # pages of 128 tokens: whole-unit steps with two warps per page
      # [variants]: sliding windows (ranges from a window's first page, masked rows), soft-capping and
      # sink logits in the decode, tile, prefill and merge kernels, eager, replayed and low-level
      for f in "[lowlevel]" "gpu: long sequences*" "gpu: pages of 128*" "[contract]" "[variants]"; do
        KVQ_GPU_TEST_SMALL=1 "$cs" --tool racecheck --error-exitcode 3 ./.gpu/kvq_cuda_tests "$f" \
          > "$OUT/racecheck_one.log" 2>&1; r=$?; echo "racecheck $f: $(tail -1 "$OUT/racecheck_one.log")" | tee -a "$OUT/racecheck.log"
        rm -f "$OUT/racecheck_one.log"; rc=$((rc | r))
      done
      # the prefill's chunk kernel (two-stage cp.async ring) and its prefix kernel (128 rows a block)
      KVQ_GPU_TEST_SMALL=1 "$cs" --tool racecheck --error-exitcode 3 ./.gpu/kvq_cuda_tests "gpu prefill: head_dim*" \
        > "$OUT/racecheck_one.log" 2>&1; r=$?; echo "racecheck [prefill]: $(tail -1 "$OUT/racecheck_one.log")" | tee -a "$OUT/racecheck.log"
      rm -f "$OUT/racecheck_one.log"; rc=$((rc | r)) ;;
    examples)
      for e in .gpu/kvq_example_*; do
        echo "== $e" >> "$OUT/examples.log"; "$e" >> "$OUT/examples.log" 2>&1; r=$?
        echo "$e: exit $r" | tee -a "$OUT/examples.log"; rc=$((rc | r))
      done
      cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
      "$cs" --tool memcheck --error-exitcode 3 .gpu/kvq_example_lowlevel_paged_attention > "$OUT/memcheck_one.log" 2>&1
      r=$?; echo "memcheck example 03: $(tail -1 "$OUT/memcheck_one.log")" | tee -a "$OUT/examples.log"
      rm -f "$OUT/memcheck_one.log"; rc=$((rc | r)) ;;
    bench)
      KVQ_BENCH_MODELS=0 ./.gpu/kvq_bench_decode_cuda --benchmark_out="$OUT/bench.json" --benchmark_out_format=json \
        --benchmark_counters_tabular=true 2>&1 | tee "$OUT/bench.log" | grep -E "decode/|append_step/" | awk '{print $1, $2, $NF}' | head -80
      # rotated / unrotated time per shape (exits 1 when a decode ratio is above 1.05)
      python3 bench/report_rotation.py "$OUT/bench.json" 2>&1 | tee "$OUT/rotation.md" | tail -40 ;;
    peer)
      python3 .gpu/peer_decode.py 2>&1 | tee "$OUT/peer.csv" ;;
    shapes)
      KVQ_BENCH_MODELS=only ./.gpu/kvq_bench_decode_cuda --benchmark_out="$OUT/shapes.json" --benchmark_out_format=json \
        --benchmark_counters_tabular=true > "$OUT/shapes.log" 2>&1; rc=$((rc | $?))
      grep -E "^decode_shape/" "$OUT/shapes.log" | awk '{print $1, $2}' | tail -n 4
      # the peer with each model's heads (the shapes bench/decode_cuda.cpp registers)
      for heads in 9:3:64 32:8:64 32:32:128 28:4:128 32:8:128 64:8:128 16:8:256 16:16:256; do
        IFS=: read -r hq hkv d <<< "$heads"
        python3 .gpu/peer_decode.py --shapes 8:4096,8:32768 --hq "$hq" --hkv "$hkv" --d "$d" 2>&1
      done > "$OUT/peer_shapes.csv"
      python3 bench/report_shapes.py "$OUT/shapes.json" "$OUT/peer_shapes.csv" --svg "$OUT/shapes.svg" \
        --csv "$OUT/shapes.csv" > "$OUT/shapes.md"; r=$?; tail -n 14 "$OUT/shapes.md"; rc=$((rc | r)) ;;
    prefill)
      ./.gpu/kvq_bench_prefill_cuda --benchmark_out="$OUT/prefill.json" --benchmark_out_format=json 2>&1 \
        | tee "$OUT/prefill.log" | grep -E "(prefill|prefix)/"; rc=$((rc | ${PIPESTATUS[0]}))
      python3 .gpu/peer_prefill.py 2> "$OUT/peer_prefill.err" | tee "$OUT/peer_prefill.csv"; rc=$((rc | ${PIPESTATUS[0]}))
      python3 - "$OUT/prefill.json" "$OUT/peer_prefill.csv" <<'PY' | tee "$OUT/prefill.md"
import csv, json, sys
# "prefill/<format>": whole prefill calls; "prefix/<format>": their prefix part alone (attend_prefix)
kvq = {" ".join(b["name"].split("/")[:2]): b["ms_per_prompt"] for b in json.load(open(sys.argv[1]))["benchmarks"]}
peer = {r[0]: float(r[1]) for r in csv.reader(l for l in open(sys.argv[2]) if l.strip() and l[0] != "#") if r[0] != "backend"}
best = min(peer, key=peer.get) if peer else None
print("| kvq call, format | kvq ms | peer (" + str(best) + ") ms | kvq / peer |\n| --- | --- | --- | --- |")
for f, ms in kvq.items():
    print(f"| {f} | {ms:.2f} | {peer[best]:.2f} | {ms / peer[best]:.2f} |" if best else f"| {f} | {ms:.2f} | - | - |")
PY
      ;;
    window)
      KVQ_BENCH_MODELS=0 KVQ_BENCH_ROTATED=0 KVQ_BENCH_FORMATS="${KVQ_WINDOW_FORMATS:-kivi4/g32;kivi2/g32;sym8;fp8;fp16}" \
        ./.gpu/kvq_bench_decode_cuda --benchmark_filter='/B8/L(4096|32768)/' --benchmark_out="$OUT/window.json" \
        --benchmark_out_format=json > "$OUT/window.log" 2>&1; rc=$((rc | $?))
      python3 bench/report_decode.py "$OUT/window.json" /dev/null | tee "$OUT/window.md" | tail -8 ;;
    flashinfer)
      fi_site=${FI_SITE:-/tmp/fi-site}
      if [ ! -d "$fi_site/flashinfer" ]; then
        echo "flashinfer: not installed in $fi_site (bench/stage_flashinfer.sh device ... first)"; rc=1; continue
      fi
      KVQ_BENCH_MODELS=0 KVQ_BENCH_ROTATED=0 KVQ_BENCH_FORMATS="${KVQ_FI_FORMATS:-fp16;fp8;sym8;kivi4/g32;kivi2/g32}" \
        ./.gpu/kvq_bench_decode_cuda --benchmark_filter='^decode/' --benchmark_out="$OUT/fi_kvq.json" \
        --benchmark_out_format=json > "$OUT/fi_kvq.log" 2>&1; rc=$((rc | $?))
      python3 .gpu/peer_decode.py > "$OUT/fi_peer.csv" 2>&1; rc=$((rc | $?))
      export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-ws}
      PYTHONPATH="$fi_site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/peer_flashinfer.py > "$OUT/peer_flashinfer.csv" 2>&1
      rc=$((rc | $?))
      PYTHONPATH="$fi_site${PYTHONPATH:+:$PYTHONPATH}" python3 bench/peer_flashinfer.py --mode prefill \
        > "$OUT/peer_flashinfer_prefill.csv" 2>&1; rc=$((rc | $?))
      python3 bench/report_decode.py "$OUT/fi_kvq.json" "$OUT/fi_peer.csv" --flashinfer "$OUT/peer_flashinfer.csv" \
        > "$OUT/decode_fi.md"; rc=$((rc | $?))
      grep -E "^\| [^ ]+ \| [0-9.]+ \| 8 \| 32768" "$OUT/decode_fi.md"; grep -v "^#" "$OUT/peer_flashinfer_prefill.csv" ;;
    python)
      PYTHONPATH="$PWD/.gpu/python" python3 -m pytest python/tests -q -p no:cacheprovider 2>&1 | tee "$OUT/python.log" \
        | tail -5; rc=$((rc | ${PIPESTATUS[0]})) ;;
    replay)
      for b in 1 8 32; do for c in 1024 32768; do
        ./.gpu/kvq_bench_replay_cuda --batch $b --context $c 2>&1 | tee -a "$OUT/replay.log"; rc=$((rc | ${PIPESTATUS[0]}))
      done; done ;;
    step)
      ./.gpu/kvq_bench_step_cuda ${KVQ_STEP_ARGS:-} 2>&1 | tee "$OUT/step.csv"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    canary)
      ./.gpu/kvq_bench_canary_cuda --steps 1280 --json "$OUT/canary.json" 2>&1 | tee "$OUT/canary.log" | grep -vE "filled|round"
      rc=$((rc | ${PIPESTATUS[0]})) ;;
    serve)
      export PYTHONPATH="${KVQ_PYTHONPATH:-$PWD/build-cuda/python}"  # the kvq package (python/README.md)
      python3 bench/serve/serve.py --out "$OUT/serve_smoke" --layers 2 --requests 6 \
        --max-steps 8 --context 2048 --kv-gib 1 > "$OUT/serve.log" 2>&1; r=$?
      rm -rf "$OUT/serve_smoke"; echo "serve: smoke run (2 layers) exit $r"; tail -3 "$OUT/serve.log"; rc=$((rc | r))
      if [ $r = 0 ]; then
        echo "serve: python3 bench/serve/serve.py --out $OUT" \
          "${KVQ_SERVE_BACKENDS:+--backends \"$KVQ_SERVE_BACKENDS\"} ${KVQ_SERVE_ARGS:-}" | tee -a "$OUT/serve.log"
        python3 bench/serve/serve.py --out "$OUT" ${KVQ_SERVE_BACKENDS:+--backends "$KVQ_SERVE_BACKENDS"} \
          ${KVQ_SERVE_ARGS:-} 2>&1 | tee -a "$OUT/serve.log"
        rc=$((rc | ${PIPESTATUS[0]}))
        python3 bench/serve/report_serve.py "$OUT/serve.json" --md "$OUT/serve.md" --plot "$OUT/serve"; rc=$((rc | $?))
      fi ;;
    ab)
      base=${KVQ_AB_BASE:-out/gpu-base}
      mkdir -p "$OUT/ab"
      for r in $(seq "${KVQ_AB_ROUNDS:-2}"); do
        for who in base new; do
          bin=$([ $who = base ] && echo "$base" || echo "${KVQ_AB_NEW:-.gpu}")/kvq_bench_decode_cuda
          # (each build with its own shared libraries first: a staged build's lib/ beside its binary)
          LD_LIBRARY_PATH="$(dirname "$bin")/lib:$LD_LIBRARY_PATH" \
            "$bin" --benchmark_filter="${KVQ_AB_FILTER:-.}" --benchmark_out="$OUT/ab/${who}_$r.json" \
            --benchmark_out_format=json >/dev/null 2>&1
          rc=$((rc | $?)); echo "ab: round $r $who done"
        done
      done
      python3 bench/ab_compare.py --counters append_us,append_busy_us "$OUT"/ab/base_*.json -- "$OUT"/ab/new_*.json | tee "$OUT/ab.md" | tail -3
      tar -czf "$OUT/ab_json.tar.gz" -C "$OUT" ab && rm -rf "$OUT/ab" ;;
  esac
done
exit $rc
