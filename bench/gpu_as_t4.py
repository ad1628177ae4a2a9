"""Run a script as if the GPU were a T4: compute capability 7.5.

`choose_precision` then picks float16 autocast with a `GradScaler`, the
path of Colab's free GPU, on whatever CUDA GPU runs this. With --scales,
the scaler's scale after every step is written to FILE (JSON), with the
number of skipped steps (a step is skipped when the scale drops).

    python bench/gpu_as_t4.py [--scales FILE] SCRIPT [ARGS...]
"""

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run a script as if the GPU were a T4 (compute"
        " capability 7.5): float16 autocast with a GradScaler."
    )
    parser.add_argument(
        "--scales", metavar="FILE", help="write the scaler's scales here"
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="the script's arguments"
    )
    return parser.parse_args(argv)


def main(argv):
    options = parse_args(argv)
    scales_file, argv = options.scales, [options.script, *options.args]
    torch.cuda.get_device_capability = lambda *args, **kwargs: (7, 5)
    scales = []
    update = torch.amp.GradScaler.update

    def recorded_update(self, *args, **kwargs):
        update(self, *args, **kwargs)
        scales.append(self.get_scale())

    torch.amp.GradScaler.update = recorded_update
    sys.argv = argv
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as python does
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        skipped = sum(b < a for a, b in zip(scales, scales[1:]))
        print(f"GradScaler: {len(scales)} updates, {skipped} skipped steps")
        if scales_file:
            with open(scales_file, "w") as f:
                record = {
                    "updates": len(scales),
                    "skipped_steps": skipped,
                    "scales": scales,
                }
                json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1:])
