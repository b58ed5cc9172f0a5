#!/usr/bin/env bash
# Installs llama-cpp-python (the peer of the CPU model runner, never a dependency of kvq) into a
# throwaway virtual environment under out/, builds kvq_llama_bench, and runs
# bench/peer_llamacpp.py with the arguments given (defaults: SmolLM2, the evaluation text, 2 threads);
# with --quality first, bench/peer_llamacpp_quality.py instead (llama.cpp's quantized caches against
# its f16 cache on kvq-eval's positions; defaults: SmolLM2, the legal text).
#   bash bench/peer_llamacpp.sh [peer_llamacpp.py options]
#   bash bench/peer_llamacpp.sh --quality [peer_llamacpp_quality.py options]
# The version is pinned so a result names what it measured; building it from PyPI's source
# distribution takes several minutes on two cores (once).
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.3.36
venv=out/peer-llamacpp
if ! "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
  python3 -m venv "$venv"
  CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$venv/bin/pip" install --no-binary llama-cpp-python "llama-cpp-python==$version" numpy
fi
if [ "${1:-}" = "--quality" ]; then
  shift
  exec "$venv/bin/python" bench/peer_llamacpp_quality.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
    --text data/eval/eval_legal.txt "$@"
fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" --target kvq_llama_bench >/dev/null
exec "$venv/bin/python" bench/peer_llamacpp.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --text data/eval/eval_persuasion.txt --kvq-bench build/tools/llama/kvq_llama_bench "$@"
