#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model, offline, with progress throughout.
#   1. materialize SmolLM2-135M (once)   2. evaluate the dense model
#   3. prune it: ALPS, transposable 16:32   4. verify the pattern   5. pack it (the sparse checkpoint format)
#   6. evaluate the pruned model   7. print the comparison table and where the files are.
# Sizes are modest so it fits a 2-core CPU; override with DEMO_* variables (see below).
set -euo pipefail

TSENOR=${TSENOR:-.venv/bin/tsenor}
MODEL=${DEMO_MODEL:-smollm2-135m} # the embedded default; tests pass a tiny checkpoint
OUT=${DEMO_OUT:-demo-out}
NSAMPLES=${DEMO_NSAMPLES:-32}     # calibration sequences (local C4 sample)
SEQLEN=${DEMO_SEQLEN:-512}        # calibration and perplexity window
WINDOWS=${DEMO_WINDOWS:-16}       # perplexity windows per dataset
TASKS=${DEMO_TASKS:-piqa,arc_easy,winogrande,rte}
LIMIT=${DEMO_LIMIT:-100}          # zero-shot documents per task

start=$(date +%s)
step() { printf '\n==> [%4ds] %s\n' "$(( $(date +%s) - start ))" "$*"; }

if [[ "$MODEL" == smollm2-135m ]]; then
  step "1/7 materialize the embedded model smollm2-135m"
  "$TSENOR" model materialize smollm2-135m
else
  step "1/7 model: $MODEL"
fi

EVAL_ARGS=(--ppl wikitext2,ptb --seqlen "$SEQLEN" --max-windows "$WINDOWS" --tasks "$TASKS" --limit "$LIMIT" --force)

step "2/7 dense model: perplexity (WikiText2, PTB; ${WINDOWS}×${SEQLEN} tokens) and zero-shot ($TASKS, $LIMIT each)"
"$TSENOR" eval "$MODEL" "${EVAL_ARGS[@]}" --output "$OUT/dense"

step "3/7 prune: ALPS, transposable 16:32, ${NSAMPLES}×${SEQLEN} local C4 calibration"
"$TSENOR" prune "$MODEL" --nm 16:32 --method alps --solver auto \
  --data c4 --nsamples "$NSAMPLES" --seqlen "$SEQLEN" --seed 0 --output "$OUT/alps-16x32" --force

step "4/7 verify: every 32×32 tile keeps at most 16 per row and column"
"$TSENOR" verify "$OUT/alps-16x32" | tail -n 5

step "5/7 pack: each pruned matrix stored as its kept values and their positions (docs/reference/packed-format.md)"
"$TSENOR" pack "$OUT/alps-16x32" -o "$OUT/alps-16x32-packed" --force
weights_mb() { du -cb "$1"/*.safetensors | tail -n 1 | awk '{printf "%.1f", $1 / 1e6}'; }
packed_sizes="$(weights_mb "$OUT/alps-16x32-packed") MB of weights against $(weights_mb "$OUT/alps-16x32") MB dense"
echo "packed: $packed_sizes"

step "6/7 pruned model: the same evaluation"
"$TSENOR" eval "$OUT/alps-16x32" "${EVAL_ARGS[@]}" --output "$OUT/alps-16x32"

step "7/7 comparison"
"$TSENOR" report "$OUT/dense" "$OUT/alps-16x32" --output "$OUT/report" --force

step "done"
echo "pruned checkpoint:   $OUT/alps-16x32 (loads with AutoModelForCausalLM.from_pretrained)"
echo "packed checkpoint:   $OUT/alps-16x32-packed ($packed_sizes; import tsenor_cli, then from_pretrained)"
echo "pruning report:      $OUT/alps-16x32/tsenor_report.md"
echo "evaluations:         $OUT/dense/eval.json, $OUT/alps-16x32/eval.json"
echo "comparison + plots:  $OUT/report/"
