# Device call, 2026-11-28: torch.compile of the training step, timed on the
# lent machine's Xeon host (AMX) beside ours and the code at issue 18.
set -u
L="$OUT/amx3"; mkdir -p "$L"
tar -xJf .dev/site.tar.xz -C /tmp
export PYTHONPATH=/tmp/devsite:$PWD MULTI30K_DIR=$PWD/.dev/multi30k \
  PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
{
  lscpu | grep -E 'Model name|^CPU\(s\)|L2|L3'
  grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort | uniq -c
  uptime
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
  command -v g++ gcc cc
} >"$L/machine.txt" 2>&1
cat "$L/machine.txt"
SECONDS=0
timeout 120 python3 -c "
import torch
f = torch.compile(lambda x: (x * 2).relu())
print(f(torch.randn(8)))" >"$L/compile_probe.log" 2>&1
echo "probe exit $? at $SECONDS s" | tee -a "$L/compile_probe.log"
tail -4 "$L/compile_probe.log"
left=$((470 - SECONDS))
timeout "$left" python3 bench/efficiency.py --presets cpu --threads 1 \
  --runs 3 --precision bf16 --sentences 2048 \
  --code-at-issue-18 .dev/the_annotated_transformer_at_c0b4240.py \
  --only "code at issue 18" --compile 2>&1 | grep -v USDT \
  | tee "$L/eff_cpu1_bf16_compile.log" \
  | grep -E 'median|/|peak|first step|rror'
echo "exit ${PIPESTATUS[0]} at $SECONDS s" | tee -a "$L/eff_cpu1_bf16_compile.log"
