#!/bin/sh
# The rotated policy comparison of docs/quality.md: on rotated caches (every (layer, kv head),
# `+rot`), kl_budget over the candidates of docs/data/calib_smollm2_rot.json (kivi 8/4/3/2,
# sym 8/4/3, codebook 4/3/2, nvfp4, fp8; its rotated damages) at 3, 4 and 5 average page bits,
# random placements of kl_budget's bytes (2 seeds each), the uniform rotated formats, EchoKV with
# rotated tiers kivi2|kivi3|kivi4|kivi8 (2 seeds), and kl_budget at 4 bits unrotated with the
# same artifact; one kvq-eval run (lockstep). Run from the repository root after building
# kvq-eval; writes out/policies_rotated_smollm2.json and .html (out/ is git-ignored).
set -eu
BUILD=${BUILD:-build}
A=${ARTIFACT:-docs/data/calib_smollm2_rot.json}
OUT=${OUT:-out/policies_rotated_smollm2}
TOKENS=${TOKENS:-512}
set -- -c fp16
for b in 3 4 5; do
  set -- "$@" -c "kl_budget:bits=$b,artifact=$A+rot"
  for s in 1 2; do set -- "$@" -c "random:seed=$s,like=kl_budget:bits=$b,artifact=$A+rot"; done
done
set -- "$@" -c "kl_budget:bits=4,artifact=$A"
for f in kivi2/g32 cb2 cb3 kivi3/g32 sym3/g32 cb4 sym4/g32 nvfp4 kivi4/g32; do set -- "$@" -c "$f+rot"; done
for s in 1 2; do set -- "$@" -c "echokv:seed=$s,tiers=kivi2/g32|kivi3/g32|kivi4/g32|kivi8/g32+rot"; done
mkdir -p "$(dirname "$OUT")"
exec "$BUILD/tools/eval/kvq-eval" -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t data/eval/eval_persuasion.txt \
  --no-needle --prefill 256 --tokens "$TOKENS" --threads 2 --json "$OUT.json" --html "$OUT.html" "$@"
