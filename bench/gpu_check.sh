#!/usr/bin/env bash
# Check the GPU paths on a lent CUDA machine, all at once, in minutes.
#
# What a reader on Colab's GPU runs, and what only a real GPU can show:
#   1. notebook 03 at full size, executed as Jupyter does (nbclient);
#   2. every notebook at CI size, through nbmake, as CI runs them;
#   3. float16 autocast with a GradScaler (a T4's path: the GPU's compute
#      capability is made to read 7.5), the quick recipe, every epoch scored;
#   4. NCCL: `train` under torchrun, one process, DDP on the GPU;
#      `--world-size 2` on one GPU refused in one line; `translate` on CUDA;
#   5. the unit tests;
#   6. R-Drop (`--rdrop 3`, one epoch of quick) in bfloat16 and float16.
# Each writes its log into $OUT/check; the folder is packed at the end.
#
#   OUT=/tmp/out bash bench/gpu_check.sh        # on the GPU machine
# bench/gpu_carry.sh builds what that machine lacks, and says how to carry it.
set -u
OUT=${OUT:?set OUT to a folder}
WALL=${WALL:-400}  # seconds before any one check is stopped
L="$OUT/check"
mkdir -p "$L"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MPLBACKEND=Agg

{
  nvidia-smi -L
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__,
torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))"
  lscpu | grep -m1 'Model name'
  nproc
} >"$L/machine.txt" 2>&1

ended() { echo "exit $1 after $(($(date +%s) - $2)) s" >>"$3"; }

notebook_full() {  # 1
  local start log="$L/03_full.log"
  start=$(date +%s)
  timeout "$WALL" python3 - >"$log" 2>&1 <<'EOF'
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
  ended $? "$start" "$log"
}

notebooks_ci() {  # 2
  local start log="$L/nbmake_ci.log"
  start=$(date +%s)
  AT_SIZE=ci timeout "$WALL" python3 -m pytest -q -p no:cacheprovider \
    --nbmake --nbmake-timeout="$WALL" -n 5 notebooks/0[1-6]_*.ipynb \
    >"$log" 2>&1
  ended $? "$start" "$log"
}

float16_scaler() {  # 3
  local start log="$L/fp16.log"
  start=$(date +%s)
  timeout "$WALL" python3 - >"$log" 2>&1 <<'EOF'
import json, os, runpy, sys
import torch

torch.cuda.get_device_capability = lambda *args, **kwargs: (7, 5)  # a T4
scales = []
update = torch.amp.GradScaler.update


def recorded_update(self, *args, **kwargs):
    update(self, *args, **kwargs)
    scales.append(self.get_scale())


torch.amp.GradScaler.update = recorded_update
out = os.path.join(os.environ["OUT"], "check")
sys.argv = ["time_to_bleu.py", "--device", "cuda", "--preset", "quick",
            "--threads", "2", "--out", f"{out}/fp16_quick.json",
            "--checkpoint-dir", "/tmp/fp16"]
try:
    runpy.run_path("bench/time_to_bleu.py", run_name="__main__")
finally:
    skipped = sum(b < a for a, b in zip(scales, scales[1:]))
    summary = {"updates": len(scales), "skipped_steps": skipped,
               "first_scale": scales[:1], "last_scale": scales[-1:]}
    print("GradScaler:", summary)
    with open(f"{out}/fp16_scaler.json", "w") as f:
        json.dump({**summary, "scales": scales}, f)
EOF
  ended $? "$start" "$log"
}

nccl_and_cli() {  # 4
  local start log="$L/nccl.log" tools=annotated_transformer_tools.py
  start=$(date +%s)
  {
    echo "== torchrun, one process, NCCL"
    timeout "$WALL" torchrun --standalone --nproc_per_node=1 "$tools" train \
      --preset ci --epochs 2 --checkpoint-dir /tmp/nccl \
      --results "$L/nccl_train.json"
    echo "exit $?"
    echo "== --world-size 2 on one GPU"
    timeout 120 python3 "$tools" train --world-size 2 --preset ci \
      --checkpoint-dir /tmp/ws2
    echo "exit $?"
    echo "== translate on CUDA (--device auto), beam 4, last 2 averaged"
    python3 "$tools" translate --checkpoint /tmp/nccl/final.pt --beam 4 \
      --average 2 "Ein Hund läuft im Park."
    echo "exit $?"
  } >"$log" 2>&1
  ended 0 "$start" "$log"
}

unit_tests() {  # 5
  local start log="$L/pytest.log"
  start=$(date +%s)
  OMP_NUM_THREADS=1 timeout "$WALL" python3 -m pytest -q -p no:cacheprovider \
    -n 6 tests --ignore=tests/test_site.py >"$log" 2>&1
  ended $? "$start" "$log"
}

rdrop_16bit() {  # 6
  local start log="$L/rdrop.log"
  start=$(date +%s)
  {
    echo "== bfloat16"
    timeout "$WALL" python3 annotated_transformer_tools.py train \
      --preset quick --epochs 1 --rdrop 3 --checkpoint-dir /tmp/rd_bf16
    echo "exit $?"
    echo "== float16 with a GradScaler (compute capability made 7.5)"
    timeout "$WALL" python3 - <<'EOF'
import runpy, sys
import torch

torch.cuda.get_device_capability = lambda *args, **kwargs: (7, 5)  # a T4
sys.argv = ["annotated_transformer_tools.py", "train", "--preset", "quick",
            "--epochs", "1", "--rdrop", "3", "--checkpoint-dir", "/tmp/rd16"]
runpy.run_path("annotated_transformer_tools.py", run_name="__main__")
EOF
    echo "exit $?"
  } >"$log" 2>&1
  ended 0 "$start" "$log"
}

notebook_full &
rdrop_16bit &
notebooks_ci &
float16_scaler &
nccl_and_cli &
unit_tests &
wait
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >>"$L/machine.txt"
tail -n 4 "$L"/*.log
tar -czf "$OUT/check.tar.gz" -C "$OUT" check && rm -rf "$L"
