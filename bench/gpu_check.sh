#!/usr/bin/env bash
# Check the GPU paths on a lent CUDA machine, all at once, in minutes.
#
# What a reader on Colab's GPU runs, and what only a real GPU can show:
#   1. notebook 03 at full size, executed as Jupyter does (nbclient);
#   2. every notebook at CI size, one after another, through nbmake, as CI
#      runs them;
#   3. float16 autocast with a GradScaler (a T4's path: bench/gpu_as_t4.py
#      makes the GPU's compute capability read 7.5), the quick recipe,
#      every epoch scored;
#   4. `train` under torchrun (one process: no process group), then a
#      process group of one (bench/gpu_ddp_one_rank.py: NCCL, DDP and its
#      collectives); `--world-size 2` on one GPU refused in one line;
#      `translate` on the GPU;
#   5. the unit tests;
#   6. R-Drop (`--rdrop 3`, one epoch of quick) in bfloat16 and float16.
# Each writes its log into $OUT/check; the folder is packed at the end. The
# exit status is 0 only if every check passed.
#
#   OUT=/tmp/out bash bench/gpu_check.sh        # on the GPU machine
# bench/gpu_carry.sh builds what that machine lacks, and says how to carry it.
set -u
OUT=${OUT:?set OUT to a folder}
WALL=${WALL:-400} # seconds before any one check is stopped
L="$OUT/check"
if [[ -e checkpoints/quick/final.pt ]]; then # notebook 03 would not train
  echo "checkpoints/quick/final.pt exists: move it away first" >&2
  exit 2
fi
mkdir -p "$L"
{
  nvidia-smi -L
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
  lscpu | grep -m1 'Model name'
  echo "CPU cores: $(nproc --all)"
} >"$L/machine.txt" 2>&1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MPLBACKEND=Agg
tools=annotated_transformer_tools.py

# Runs "$@" with a time limit, appending its exit status to the log $LOG.
timed() {
  timeout "$WALL" "$@" >>"$LOG" 2>&1
  local status=$?
  echo "exit $status" >>"$LOG"
  return $status
}

notebook_full() { # 1
  LOG="$L/03_full.log" timed python3 - <<'EOF'
import nbclient, nbformat, os
nb = nbformat.read("notebooks/03_multi30k.ipynb", as_version=4)
client = nbclient.NotebookClient(
    nb, timeout=None, resources={"metadata": {"path": "notebooks"}}
)
try:
    client.execute()
finally:
    nbformat.write(nb, os.path.join(os.environ["OUT"], "check", "03_full.ipynb"))
EOF
}

notebooks_ci() { # 2
  AT_SIZE=ci LOG="$L/nbmake_ci.log" timed python3 -m pytest -q \
    -p no:cacheprovider --nbmake --nbmake-timeout="$WALL" \
    notebooks/0[1-6]_*.ipynb
}

float16_scaler() { # 3
  LOG="$L/fp16.log" timed python3 bench/gpu_as_t4.py \
    --scales "$L/fp16_scaler.json" bench/time_to_bleu.py --device cuda \
    --preset quick --threads 2 --out "$L/fp16_quick.json" \
    --checkpoint-dir /tmp/fp16
}

torchrun_and_cli() { # 4
  local failed=0 LOG="$L/torchrun.log"
  echo "== train under torchrun, one process" >>"$LOG"
  timed torchrun --standalone --nproc_per_node=1 "$tools" train \
    --preset ci --epochs 2 --checkpoint-dir /tmp/ci2 \
    --results "$L/torchrun_train.json" || failed=1
  echo "== a process group of one (NCCL on CUDA)" >>"$LOG"
  timed torchrun --standalone --nproc_per_node=1 bench/gpu_ddp_one_rank.py \
    /tmp/ddp1 || failed=1
  echo "== --world-size 2 on one GPU: one line, exit 2" >>"$LOG"
  timed python3 "$tools" train --world-size 2 --preset ci \
    --checkpoint-dir /tmp/ws2
  [[ $(tail -n 1 "$LOG") == "exit 2" ]] || failed=1
  echo "== translate on the GPU (--device auto), beam 4, last 2 averaged" \
    >>"$LOG"
  [[ -e /tmp/ci2/final.pt ]] && timed python3 "$tools" translate \
    --checkpoint /tmp/ci2/final.pt --beam 4 --average 2 \
    "Ein Hund läuft im Park." || failed=1
  return $failed
}

unit_tests() { # 5
  OMP_NUM_THREADS=1 LOG="$L/pytest.log" timed python3 -m pytest -q \
    -p no:cacheprovider -n 6 tests --ignore=tests/test_site.py
}

rdrop_16bit() { # 6
  local failed=0 LOG="$L/rdrop.log"
  echo "== bfloat16" >>"$LOG"
  timed python3 "$tools" train --preset quick --epochs 1 --rdrop 3 \
    --checkpoint-dir /tmp/rd_bf16 || failed=1
  echo "== float16 with a GradScaler (compute capability made 7.5)" >>"$LOG"
  timed python3 bench/gpu_as_t4.py "$tools" train --preset quick \
    --epochs 1 --rdrop 3 --checkpoint-dir /tmp/rd16 || failed=1
  return $failed
}

checks=(notebook_full notebooks_ci float16_scaler torchrun_and_cli
  unit_tests rdrop_16bit)
pids=()
for check in "${checks[@]}"; do
  "$check" &
  pids+=($!)
done
status=0
for i in "${!checks[@]}"; do
  if wait "${pids[$i]}"; then
    echo "passed: ${checks[$i]}" | tee -a "$L/summary.txt"
  else
    echo "FAILED: ${checks[$i]}" | tee -a "$L/summary.txt"
    status=1
  fi
done
tail -n 4 "$L"/*.log
tar -czf "$OUT/check.tar.gz" -C "$OUT" check && rm -rf "$L"
exit $status
