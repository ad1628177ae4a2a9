# One device call: issue 18's 2x bf16 goal measured on the lent machine's
# Intel Xeon host (the CPU class the issue's baseline was timed on), then
# notebook 03 at full size on the GPU (its batched-decoding check).
set -u
L="$OUT/amx"; mkdir -p "$L"
tar -xJf .dev/site.tar.xz -C /tmp
export PYTHONPATH=/tmp/devsite:$PWD/bench/gpu_stub:$PWD \
  MULTI30K_DIR=$PWD/.dev/multi30k PYTHONUNBUFFERED=1 MPLBACKEND=Agg
{
  lscpu | grep -E 'Model name|^CPU\(s\)|MHz|L2|L3'
  grep -o -w -E 'avx512_bf16|amx_bf16|amx_tile' /proc/cpuinfo | sort | uniq -c
  uptime
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
} >"$L/machine.txt" 2>&1
cat "$L/machine.txt"
old=.dev/the_annotated_transformer_at_c0b4240.py
eff() { # seconds threads runs sentences log [extra...]
  local w=$1 t=$2 r=$3 s=$4 log=$5; shift 5
  timeout "$w" python3 bench/efficiency.py --presets cpu --threads "$t" \
    --runs "$r" --precision bf16 --sentences "$s" --code-at-issue-18 "$old" \
    --only "code at issue 18" nn.Transformer "ours, nn.Dropout" "$@" \
    2>&1 | grep -v USDT >"$L/$log"
  echo "exit ${PIPESTATUS[0]}" >>"$L/$log"
  grep -E 'median|ours /|peak' "$L/$log"
}
SECONDS=0
eff 390 1 5 2048 eff_cpu1_bf16_issue18.log --profile 12
echo "1 thread done at $SECONDS s"
timeout 150 python3 - >"$L/03_full.log" 2>&1 <<'PY'
import nbclient, nbformat, os
nb = nbformat.read("notebooks/03_multi30k.ipynb", as_version=4)
client = nbclient.NotebookClient(
    nb, timeout=None, resources={"metadata": {"path": "notebooks"}}
)
try:
    client.execute()
finally:
    nbformat.write(nb, os.path.join(os.environ["OUT"], "amx", "03_full.ipynb"))
PY
echo "notebook exit $? at $SECONDS s" | tee -a "$L/03_full.log"
left=$((540 - SECONDS))
if ((left > 60)); then
  eff "$left" 2 3 2048 eff_cpu2_bf16_issue18.log
  echo "2 threads done at $SECONDS s"
fi
