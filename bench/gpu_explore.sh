#!/usr/bin/env bash
# Explore best-recipe levers on a lent GPU, on the validation split only.
#
# Several time_to_bleu.py trials share one GPU, two CPU threads each; then
# bleu_table.py scores each on the whole validation split (greedy, beam 4
# with length penalty 1.0, and beam 4 on the average of the last 5 epoch
# files). Nothing here reads a test set. Every file lands in $OUT and is
# packed into $OUT/explore.tar.gz.
#
#   OUT=/tmp/out bash bench/gpu_explore.sh             # on the GPU machine
#   OUT=/tmp/out DEVICE=cpu TRIALS=ci VAL_N=20 bash bench/gpu_explore.sh  # dry run
set -u
OUT=${OUT:?set OUT to a folder}
DEVICE=${DEVICE:-cuda}
MINUTES=${MINUTES:-5}       # training minutes per trial, scoring excluded
WALL=${WALL:-450}           # seconds before a trial is stopped regardless
RUNS=${RUNS:-/tmp/explore}  # epoch files: too large to bring back
VAL_N=${VAL_N:-0}           # validation sentences scored at the end (0: all)
mkdir -p "$OUT/explore" "$RUNS"

# name | preset | epochs | --set pairs
trials_gpu() {
  cat <<'EOF'
g-d02-e18|cpu|18|dropout=0.2
g-d025-e24|cpu|24|dropout=0.25
g-d03-e30|cpu|30|dropout=0.3
g-ls02-d02-e18|cpu|18|dropout=0.2 label_smoothing=0.2
g-wide-d03-e24|cpu|24|dropout=0.3 d_model=512 d_ff=2048 h=8
g-deep-d02-e24|cpu|24|dropout=0.2 N=6
g-bpe-d03-e30|cpu-bpe|30|dropout=0.3
EOF
}
trials_ci() { echo "c-ci|ci|2|dropout=0.1"; }

train() {  # one trial in the background
  local name=$1 preset=$2 epochs=$3 sets=$4 args=()
  for s in $sets keep_last=0; do args+=(--set "$s"); done
  timeout "$WALL" python bench/time_to_bleu.py --device "$DEVICE" \
    --preset "$preset" --epochs "$epochs" "${args[@]}" --val-pairs 300 \
    --threads 2 --minutes "$MINUTES" --out "$OUT/explore/$name.json" \
    --checkpoint-dir "$RUNS/$name" >"$OUT/explore/$name.log" 2>&1 &
}

score() {  # one validation table in the background
  local name=$1 preset=$2 kind=--word
  [[ $preset == *-bpe ]] && kind=--bpe
  timeout 240 python bench/bleu_table.py "$kind" "$RUNS/$name" --split val \
    --beam 4 --alpha 1.0 --average 5 --threads 2 --n "$VAL_N" \
    --out "$OUT/explore/${name}_val" >>"$OUT/explore/$name.log" 2>&1 &
}

"trials_${TRIALS:-gpu}" >"$OUT/explore/trials.txt"
while IFS='|' read -r name preset epochs sets; do
  train "$name" "$preset" "$epochs" "$sets"
done <"$OUT/explore/trials.txt"
wait
while IFS='|' read -r name preset _ _; do
  score "$name" "$preset"
done <"$OUT/explore/trials.txt"
wait
for f in "$OUT"/explore/*_val.md; do echo "== $f"; cat "$f"; done
tail -n 3 "$OUT"/explore/*.log
tar -czf "$OUT/explore.tar.gz" -C "$OUT" explore && rm -rf "$OUT/explore"
