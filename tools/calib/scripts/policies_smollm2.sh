#!/bin/sh
# The policy comparison of docs/quality.md: kl_budget, autok, the nearest uniform
# formats and random (3 seeds, the bytes of kl_budget) at 4, 5 and 6 average bits, and EchoKV
# (3 seeds, with and without hysteresis, at the default canary rate and at 1/16), all in one
# kvq-eval run (lockstep: every configuration sees the same positions). Run from the repository
# root after building kvq-eval; the artifact is docs/data/calib_smollm2.json (kvq-calibrate wrote it).
# Writes out/policies_smollm2.json and .html (out/ is git-ignored).
# The autok phi values protect exactly 5, 10 and 15 of 30 layers (kivi8 on those, kivi2 on the
# rest: 3 + 6n/30 = 4, 5, 6 bits): each is the midpoint between the cumulative sensitivity
# shares of the n-1 and n most sensitive layers of the artifact (kivi2 damage, K + V).
set -eu
BUILD=${BUILD:-build-calib}
A=${ARTIFACT:-docs/data/calib_smollm2.json}
OUT=${OUT:-out/policies_smollm2}
TOKENS=${TOKENS:-512}
set -- -c fp16
for b in 4 5 6; do
  set -- "$@" -c "kl_budget:bits=$b,artifact=$A"
  for s in 1 2 3; do set -- "$@" -c "random:seed=$s,like=kl_budget:bits=$b,artifact=$A"; done
done
set -- "$@" -c "autok:phi=0.1913,high=kivi8/g32,low=kivi2/g32,artifact=$A" \
            -c "autok:phi=0.3792,high=kivi8/g32,low=kivi2/g32,artifact=$A" \
            -c "autok:phi=0.5486,high=kivi8/g32,low=kivi2/g32,artifact=$A" \
            -c "k=kivi4/g32,v=kivi2/g32" -c "sym4/g32" -c "kivi4/g32" -c "k=kivi8/g32,v=kivi2/g32"
for rate in 0.015625 0.0625; do
  for s in 1 2 3; do
    set -- "$@" -c "echokv:seed=$s,rate=$rate" -c "echokv:seed=$s,rate=$rate,hysteresis=1"
  done
done
mkdir -p "$(dirname "$OUT")"
exec "$BUILD/tools/eval/kvq-eval" -m models/SmolLM2-135M-Instruct.Q4_1.gguf -t data/eval/eval_persuasion.txt \
  --no-needle --prefill 256 --tokens "$TOKENS" --threads 2 --json "$OUT.json" --html "$OUT.html" "$@"
