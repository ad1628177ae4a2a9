"""A process group of one, under torchrun: what `train` skips.

`train` started by torchrun with one process trains without a process
group (`is_distributed` is `world > 1`). This script trains the `ci` preset
as a group of one instead, so that on one GPU `init_process_group("nccl")`,
DDP with `device_ids`, the losses' float64 `all_reduce` and
`params_in_sync`'s `all_gather` all run (gloo on a CPU).

    torchrun --standalone --nproc_per_node=1 bench/gpu_ddp_one_rank.py DIR
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402
import the_annotated_transformer as tat  # noqa: E402


def main(folder):
    joined = []  # the backends of the groups joined, recorded on the way
    join_group = tools.join_group

    def recorded(device, *args, **kwargs):
        joined.append(tools.backend_for(device))
        return join_group(device, *args, **kwargs)

    tools.join_group = recorded  # what TrainingRun calls
    rank, world, local_rank, local_world = tools.torchrun_ranks()
    device = tools.process_device(local_rank, local_world)
    config = tools.get_config("ci", epochs=1, checkpoint_dir=folder)
    tokenizers = tat.load_tokenizers()
    vocabs = tools.load_vocabularies(config, *tokenizers)
    tools.train_worker(
        rank,
        world,
        *vocabs,
        *tokenizers,
        config,
        is_distributed=True,
        show_progress=False,
        device=device,
    )
    final = tools.load_checkpoint(Path(folder, "final.pt"))
    print("process groups joined:", joined, "device:", device)
    print("ranks_in_sync:", final.get("ranks_in_sync"))
    return 0 if joined and final.get("ranks_in_sync") is True else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Under torchrun: train the ci preset as a process group"
        " of one (NCCL on CUDA, gloo on a CPU)."
    )
    parser.add_argument("folder", help="where the checkpoints go")
    sys.exit(main(parser.parse_args().folder))
