# Second device call: the bound on removing autocast's casts, on the Xeon.
set -u
L="$OUT/amx2"; mkdir -p "$L"
tar -xJf .dev/site.tar.xz -C /tmp
export PYTHONPATH=/tmp/devsite:$PWD MULTI30K_DIR=$PWD/.dev/multi30k PYTHONUNBUFFERED=1
uptime
timeout 170 python3 bench/efficiency.py --presets cpu --threads 1 --runs 3 \
  --precision bf16 --sentences 2048 \
  --code-at-issue-18 .dev/the_annotated_transformer_at_c0b4240.py \
  --only "ours, wholly bf16" "code at issue 18" 2>&1 | grep -v USDT \
  | tee "$L/eff_cpu1_bf16_wholly.log" | grep -E 'median|ours|peak|exit'
echo "exit ${PIPESTATUS[0]}" | tee -a "$L/eff_cpu1_bf16_wholly.log"
