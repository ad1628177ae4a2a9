"""Run named training settings through time_to_bleu.py; record each trial.

Every trial, failures included, becomes one row of `results/recipe_sweep.md`
(setting, validation BLEU, training time, steps), and its full run is kept
as JSON in `results/recipe_sweep/NAME.json`. Only the validation split is
scored: the sweep never reads a test set.

    python bench/recipe_sweep.py --threads 2 linear-w100 small-batch
    python bench/recipe_sweep.py --list
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "time_to_bleu.py"
sys.path.insert(0, str(ROOT))

import annotated_transformer_tools as tools  # noqa: E402

# Each setting: a preset, TrainConfig replacements, and a step budget
# sized for about 13 minutes of training on 2 shared threads of a 2-core
# AMD EPYC in float32 (measured there: about 3.4 s per 3,000-token step).
SETTINGS = {
    "linear-w100": {
        "why": "Noam schedule replaced by linear decay to zero at the step"
        " budget; warm-up 100 (not 800); dropout off for a short run",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 100,
            "factor": 0.5,
            "dropout": 0.0,
        },
        "max_steps": 240,
        "eval_every": 80,
    },
    "linear-w150-1500tok": {
        "why": "as linear-w100, half the tokens per batch: twice the steps",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 150,
            "factor": 0.5,
            "dropout": 0.0,
            "max_tokens": 1500,
        },
        "max_steps": 480,
        "eval_every": 160,
    },
    "linear-w150-1500tok-peak2x": {
        "why": "as linear-w150-1500tok with twice the peak learning rate",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 150,
            "factor": 1.0,
            "dropout": 0.0,
            "max_tokens": 1500,
        },
        "max_steps": 480,
        "eval_every": 160,
    },
    "linear-w100-peak2x": {
        "why": "as linear-w100 with twice the peak learning rate",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 100,
            "factor": 1.0,
            "dropout": 0.0,
        },
        "max_steps": 240,
        "eval_every": 80,
    },
    # From here on, step budgets are sized for about 14 minutes on 2 idle
    # threads of the same machine: 512 ms per 1,500-token step of the cpu
    # model, measured alone (the earlier trials ran beside other work and
    # got 1-1.3 cores). A trial's score depends on its steps, not on how
    # busy the machine was, so only the final recipe's time needs an idle
    # machine.
    "q1600-d01": {
        "why": "1,600 steps of 1,500 tokens (about 5 epochs), linear decay"
        " to zero, warm-up 200, peak about 2.7e-3, dropout 0.1",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 200,
            "factor": 0.6,
            "dropout": 0.1,
            "max_tokens": 1500,
        },
        "max_steps": 1600,
        "eval_every": 400,
    },
    "q1600-d00": {
        "why": "as q1600-d01 without dropout",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 200,
            "factor": 0.6,
            "dropout": 0.0,
            "max_tokens": 1500,
        },
        "max_steps": 1600,
        "eval_every": 400,
    },
    # q1600-d01 learned fast at first, then slower than the cpu recipe's
    # Noam schedule did with 3,000-token batches (validation loss 1.93
    # against 1.78 after 1.6 million target tokens). Next: 3,000-token
    # batches with a linear schedule. Dropout makes a step about 28%
    # slower on this CPU (the random masks), so the two trials below
    # get equal time, not equal steps: 1,016 ms a step without dropout.
    "q3000-d00": {
        "why": "3,000-token batches, warm-up 300, peak 2.2e-3 (the cpu"
        " recipe's), linear decay to zero, no dropout; about 14 minutes",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 300,
            "factor": 0.61,
            "dropout": 0.0,
        },
        "max_steps": 840,
        "eval_every": 210,
    },
    "q3000-d01": {
        "why": "as q3000-d00 with dropout 0.1, for the same time",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 300,
            "factor": 0.61,
            "dropout": 0.1,
        },
        "max_steps": 660,
        "eval_every": 220,
    },
    # Toward a best recipe: the quick recipe's schedule over a longer
    # run, with dropout back on (12 epochs are enough to overfit).
    "long-d01-e12": {
        "why": "the quick recipe's schedule over 12 epochs (1,836 steps),"
        " dropout 0.1; about 40 minutes on 2 idle threads",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 300,
            "factor": 0.61,
            "dropout": 0.1,
        },
        "max_steps": 1836,
        "eval_every": 459,
    },
    # long-d01-e12's validation loss stopped falling after epoch 9 while
    # its training loss kept falling: it overfits. Two longer runs with
    # three times the dropout, side by side (one thread each); the second
    # also has one BPE vocabulary with tied embeddings (no <unk>). Every
    # epoch file is kept, to choose on validation which ones to average.
    "best-d03-e14": {
        "why": "long-d01-e12 with dropout 0.3, over 14 epochs (2,142 steps)",
        "preset": "cpu",
        "set": {
            "schedule": "linear",
            "warmup": 300,
            "factor": 0.61,
            "dropout": 0.3,
            "keep_last": 0,
        },
        "max_steps": 2142,
        "eval_every": 0,
    },
    "best-bpe-d03-e14": {
        "why": "best-d03-e14 with BPE and tied embeddings (about 160 steps"
        " an epoch, so 2,240 steps)",
        "preset": "cpu-bpe",
        "set": {
            "schedule": "linear",
            "warmup": 300,
            "factor": 0.61,
            "dropout": 0.3,
            "keep_last": 0,
        },
        "max_steps": 2240,
        "eval_every": 0,
    },
    # Both were stopped by hand after 10 and 8 epochs: dropout 0.3
    # underfits this d_model=256 model (see results/recipe_sweep.md). The
    # 18-epoch cpu run A scored 40.19 with beam 4 + averaging, <unk> kept;
    # <unk> replacement added 1.3 greedy to long-d01-e12. So: the cpu
    # preset unchanged (Noam schedule, dropout 0.1, 18 epochs), every
    # epoch file kept, its decoding chosen on validation.
    "cpu-e18": {
        "why": "the cpu preset as it is (18 epochs, Noam, dropout 0.1),"
        " keeping every epoch file; about 65 minutes on 2 idle threads",
        "preset": "cpu",
        "set": {"keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
    },
    # cpu-e18 overfits from about epoch 8 (validation loss 1.45, then
    # rising) and dropout 0.3 underfits: a point between, with the same
    # Noam schedule, and every epoch file kept for averaging.
    "cpu-d02-e14": {
        "why": "the cpu preset with dropout 0.2 over 14 epochs, every"
        " epoch file kept; about 60 minutes on 2 idle threads",
        "preset": "cpu",
        "set": {"dropout": 0.2, "epochs": 14, "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
    },
    # cpu-e18 was stopped after epoch 10 for the session's time. This
    # continues it from its training state (last.pt) in a copy of its
    # folder, so the recorded cpu-e18 stays as it was. Not run by this
    # script: the command is below, and bench/stopped_trial.py --resumed
    # records it.
    "cpu-e18-e14": {
        "why": "cpu-e18 continued to 14 epochs with train --resume",
        "preset": "cpu",
        "set": {"keep_last": 0, "epochs": 14},
        "max_steps": 0,
        "eval_every": 0,
        "resumes": "cpu-e18",
        "resume_command": "cp -rp runs/recipe_sweep/cpu-e18"
        " runs/recipe_sweep/cpu-e18-e14 && python -m"
        " annotated_transformer_tools train --preset cpu --resume"
        " --epochs 14 --keep-last 0 --threads 2"
        " --checkpoint-dir runs/recipe_sweep/cpu-e18-e14",
    },
    # cpu-d02-e14's validation loss was still falling, a little, at its
    # last epoch: the same continued to 18 epochs.
    "cpu-d02-e18": {
        "why": "cpu-d02-e14 continued to 18 epochs from its training"
        " state (train_model with resume=True)",
        "preset": "cpu",
        "set": {"dropout": 0.2, "epochs": 18, "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
        "resumes": "cpu-d02-e14",
        # The command line's train has no --dropout: the same in Python.
        "resume_command": "cp -rp runs/recipe_sweep/cpu-d02-e14"
        ' runs/recipe_sweep/cpu-d02-e18 && python -c "import torch,'
        " annotated_transformer_tools as t; torch.set_num_threads(2);"
        " c = t.get_config('cpu', dropout=0.2, epochs=18, keep_last=0,"
        " checkpoint_dir='runs/recipe_sweep/cpu-d02-e18');"
        " tok = t.load_tokenizers();"
        " t.train_model(*t.load_vocabularies(c, *tok), *tok, c,"
        ' resume=True)"',
    },
    # A third ensemble member: cpu-d02-e18's recipe from another seed.
    # Stopped by hand after 12 of 18 epochs, recorded from its log.
    "cpu-d02-e18-s1": {
        "why": "cpu-d02-e18's recipe (dropout 0.2, 18 epochs) from seed 1",
        "preset": "cpu",
        "set": {"dropout": 0.2, "seed": 1, "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
    },
    # The same, continued to all 18 epochs from its training state, in a
    # copy of its folder; bench/stopped_trial.py --resumed records it.
    "cpu-d02-e18-s1-e18": {
        "why": "cpu-d02-e18-s1 continued to 18 epochs from its training"
        " state (train_model with resume=True)",
        "preset": "cpu",
        "set": {"dropout": 0.2, "seed": 1, "epochs": 18, "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
        "resumes": "cpu-d02-e18-s1",
        "resume_command": "cp -rp runs/recipe_sweep/cpu-d02-e18-s1"
        " runs/recipe_sweep/cpu-d02-e18-s1-e18 && rm"
        " runs/recipe_sweep/cpu-d02-e18-s1-e18/final.pt && python -c"
        ' "import torch, annotated_transformer_tools as t;'
        " torch.set_num_threads(2); c = t.get_config('cpu', dropout=0.2,"
        " seed=1, epochs=18, keep_last=0,"
        " checkpoint_dir='runs/recipe_sweep/cpu-d02-e18-s1-e18');"
        " tok = t.load_tokenizers();"
        " t.train_model(*t.load_vocabularies(c, *tok), *tok, c,"
        ' resume=True)"',
    },
    # The Noam schedule ends at half its peak rate, which is why averaging
    # the last epochs helps it so much. The one lever changed against
    # cpu-d02-e18 (which was cpu-d02-e14 resumed): the rate falls in a
    # straight line to zero at the last step, with the same warm-up (800)
    # and peak (2.2e-3), over the same 18 epochs. Stopped by hand after
    # epoch 4 (765 steps, still inside the warm-up) for the session's time.
    "cpu-d02-lin-e18": {
        "why": "cpu-d02-e18 with a linear decay to zero at its last step",
        "preset": "cpu",
        "set": {"dropout": 0.2, "schedule": "linear", "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
    },
    # The same run resumed after epoch 4 with a budget of 10 epochs (a
    # 14-epoch budget was begun, then stopped in its first epoch for the
    # session's time). Up to step 800 both schedules only warm up,
    # identically, so this is the run a fresh 10-epoch budget gives. Its
    # pair: cpu-d02-e14's first 10 epochs, the same run under the Noam
    # schedule (which has no budget), scored from its epoch files.
    "cpu-d02-lin-e10": {
        "why": "cpu-d02-e14's first 10 epochs with a linear decay to zero",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "epochs": 10,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
        "resumes": "cpu-d02-lin-e18",
        "resume_command": "cp -rp runs/recipe_sweep/cpu-d02-lin-e18"
        " runs/recipe_sweep/cpu-d02-lin-e10 && python -c"
        ' "import torch, annotated_transformer_tools as t;'
        " torch.set_num_threads(2); c = t.get_config('cpu', dropout=0.2,"
        " schedule='linear', epochs=10, keep_last=0,"
        " checkpoint_dir='runs/recipe_sweep/cpu-d02-lin-e10');"
        " tok = t.load_tokenizers();"
        " t.train_model(*t.load_vocabularies(c, *tok), *tok, c,"
        ' resume=True)"',
    },
    # The pair of cpu-d02-e18 (Noam, 18 epochs, seed 0) under a linear
    # decay to zero at its last step, run from scratch in one go: the same
    # warm-up (800), peak (2.2e-3), dropout, seed and 18 epochs.
    "cpu-d02-lin18": {
        "why": "cpu-d02-e18 with a linear decay to zero at its last step,"
        " run in one go",
        "preset": "cpu",
        "set": {"dropout": 0.2, "schedule": "linear", "keep_last": 0},
        "max_steps": 0,
        "eval_every": 0,
    },
    # The same from seed 1: a second member for an ensemble.
    "cpu-d02-lin18-s1": {
        "why": "cpu-d02-lin18 from seed 1, an ensemble member",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "seed": 1,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # A third seed of the 18-epoch linear decay: a fourth ensemble member.
    "cpu-d02-lin18-s2": {
        "why": "cpu-d02-lin18 from seed 2, an ensemble member",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "seed": 2,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # cpu-d02-lin18's validation loss was still falling at its last epoch
    # (1.463, its lowest), so the linear decay may gain from more steps:
    # the same run over 24 epochs (153 x 24 = 3,672 steps instead of
    # 2,754), decaying to zero at the last one.
    "cpu-d02-lin24": {
        "why": "cpu-d02-lin18 over 24 epochs: a longer linear decay",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "epochs": 24,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # The levers the GPU tried left weight decay out. AdamW's decoupled
    # decay of 0.1 on cpu-d02-lin18: the summed learning rate of its
    # schedule is about 3, so a weight without gradient would shrink by
    # e^-0.3 over the run.
    "cpu-d02-lin18-wd01": {
        "why": "cpu-d02-lin18 with AdamW, weight decay 0.1",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.1,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # cpu-d02-lin18-wd01 ended with validation loss 1.419 against 1.463
    # without the decay, and 40.84 against 40.68 with the best decoding:
    # twice the decay, to see which way the lever goes.
    "cpu-d02-lin18-wd02": {
        "why": "cpu-d02-lin18 with AdamW, weight decay 0.2",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # cpu-d02-lin18-wd02 (41.01 on validation) beat wd01 (40.84) and no
    # decay (40.68): a larger decay, to find where the lever turns.
    "cpu-d02-lin18-wd03": {
        "why": "cpu-d02-lin18 with AdamW, weight decay 0.3",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.3,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # The best single model from another seed: an ensemble member, and a
    # measure of how much of wd02's lead over wd01 is the seed.
    "cpu-d02-lin18-wd02-s1": {
        "why": "cpu-d02-lin18-wd02 from seed 1, an ensemble member",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "seed": 1,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin24-wd02": {
        "why": "cpu-d02-lin18-wd02 over 24 epochs: the longer linear decay"
        " that helped cpu-d02-lin24 as an ensemble member, with the decay",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "epochs": 24,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-N4": {
        "why": "cpu-d02-lin18-wd02 with 4 layers in the encoder and in the"
        " decoder, not 3: more capacity, held back by dropout and decay",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "N": 4,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # Four layers and 24 epochs did not beat wd02 alone. A lever that
    # removes parameters instead: the generator reuses the target
    # embedding (Part 5's tie, on the English side alone, since the word
    # vocabularies differ), from two seeds to see past the seed's 0.24.
    "cpu-d02-lin18-wd02-tie": {
        "why": "cpu-d02-lin18-wd02 with the generator tied to the target"
        " embedding (word-level: English side only)",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-s1": {
        "why": "cpu-d02-lin18-wd02-tie from seed 1",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 1,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # The tie gave the best single model (41.51 on validation, seed 1) but
    # two tied runs together only 41.87: two more seeds, for a four-model
    # ensemble of the tied recipe.
    "cpu-d02-lin18-wd02-tie-s2": {
        "why": "cpu-d02-lin18-wd02-tie from seed 2, an ensemble member",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 2,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-s3": {
        "why": "cpu-d02-lin18-wd02-tie from seed 3, an ensemble member",
        "preset": "cpu",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 3,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    # Sequence-level distillation (bench/distill.py): the four tied models
    # above, decoding together (42.41 on validation), translated the
    # training German; one model of the same recipe learns their English.
    # "data" is the folder whose training pairs the trial trains on
    # (time_to_bleu.py --data).
    "cpu-d02-lin18-wd02-tie-s1-kd": {
        "why": "cpu-d02-lin18-wd02-tie-s1 trained on the four tied models'"
        " translations of the training German (beam 4, alpha 1.0)",
        "preset": "cpu",
        "data": "data/distilled-tie4",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 1,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-s1-kdmix": {
        "why": "as cpu-d02-lin18-wd02-tie-s1-kd, on the distilled pairs and"
        " the original ones (twice the pairs an epoch, so half the epochs)",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 1,
            "epochs": 9,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-kdmix": {
        "why": "cpu-d02-lin18-wd02-tie-s1-kdmix from seed 0: is the"
        " student's gain on validation more than seed noise?",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "epochs": 9,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-s2-kdmix": {
        "why": "the student from a third seed: its two seeds scored 42.24"
        " and 42.04 on validation; how wide is the spread?",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "seed": 2,
            "epochs": 9,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-kdmix-e12": {
        "why": "cpu-d02-lin18-wd02-tie-kdmix for 12 epochs, not 9: its"
        " validation loss still fell in the last epoch (1.4175, 1.4157)",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "epochs": 12,
            "keep_last": 0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
    "cpu-d02-lin18-wd02-tie-kdmix-rd3": {
        "why": "cpu-d02-lin18-wd02-tie-kdmix with R-Drop, alpha 3 (the"
        " appendix): do two dropout passes that must agree lift one"
        " model? A step costs about twice as much",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "epochs": 9,
            "keep_last": 0,
            "rdrop": 3.0,
        },
        "max_steps": 0,
        "eval_every": 0,
        # Two epochs ran side by side with -rd5, one thread each, about 15
        # minutes an epoch; -rd5 was then stopped and this one continued
        # from its training state, in its own folder, with both threads.
        "resume_command": "python annotated_transformer_tools.py train"
        " --preset cpu --dropout 0.2 --schedule linear --weight-decay 0.2"
        " --tie-embeddings --epochs 9 --keep-last 0 --rdrop 3"
        " --data data/distilled-tie4-mix --resume --threads 2"
        " --checkpoint-dir runs/recipe_sweep/cpu-d02-lin18-wd02-tie-kdmix-rd3",
    },
    "cpu-d02-lin18-wd02-tie-kdmix-rd5": {
        "why": "cpu-d02-lin18-wd02-tie-kdmix-rd3 with alpha 5, the value"
        " the R-Drop authors used for IWSLT14 German-English",
        "preset": "cpu",
        "data": "data/distilled-tie4-mix",
        "set": {
            "dropout": 0.2,
            "schedule": "linear",
            "weight_decay": 0.2,
            "tie_embeddings": True,
            "epochs": 9,
            "keep_last": 0,
            "rdrop": 5.0,
        },
        "max_steps": 0,
        "eval_every": 0,
    },
}

TABLE_HEAD = (
    "| trial | setting | steps | train min | val BLEU (final / best)"
    " | val loss | load avg | result |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


def command_for(name, setting, args):
    """The time_to_bleu.py command line of one trial."""
    command = [sys.executable, str(BENCH), "--preset", setting["preset"]]
    for key, value in setting["set"].items():
        command += ["--set", f"{key}={value}"]
    command += ["--max-steps", str(setting["max_steps"])]
    command += ["--eval-every", str(setting["eval_every"])]
    command += ["--minutes", str(args.minutes), "--threads", str(args.threads)]
    command += ["--out", str(args.out_dir / f"{name}.json")]
    command += ["--checkpoint-dir", f"runs/recipe_sweep/{name}"]
    if "data" in setting:  # training pairs from another folder
        command += ["--data", setting["data"]]
    return command


def describe(setting):
    """The setting as a short text for the table."""
    pairs = [f"{k}={v}" for k, v in setting["set"].items()]
    data = f" (data: {setting['data']})" if "data" in setting else ""
    return f"{setting['preset']}{data}: " + ", ".join(pairs)


def args_minutes(result):
    """The --minutes limit a trial ran under, from its command."""
    words = result["command"].split()
    return float(words[words.index("--minutes") + 1])


def append_row(table, name, setting, result, failure):
    """Add one trial to the Markdown table, creating it if needed."""
    table = Path(table)
    table.parent.mkdir(parents=True, exist_ok=True)
    if not table.is_file():
        table.write_text(
            "# Recipe sweep (validation split only)\n\n"
            "Each row is one trial of `bench/recipe_sweep.py`; its full run"
            " is in `results/recipe_sweep/<trial>.json`.\n\n" + TABLE_HEAD
        )
    if failure:
        row = f"| {name} | {describe(setting)} | | | | | | failed: {failure} |"
    else:
        last = result["points"][-1]
        bleu = (
            f"{result['final_val_bleu']:.2f} / {result['best_val_bleu']:.2f}"
        )
        load = last["load_average"]
        note = "ok"
        if last["steps"] < result["max_steps"]:
            note = "stopped by the time limit before its step budget"
        elif result["train_seconds"] > 60 * args_minutes(result):
            note = "ok, but over the time limit"
        minutes = result["train_seconds"] / 60
        row = (
            f"| {name} | {describe(setting)} | {last['steps']} |"
            f" {minutes:.1f} | {bleu} | {last['val_loss']:.3f} | {load} |"
            f" {note} |"
        )
    with table.open("a") as f:
        f.write(row + "\n")


def run_trial(name, setting, args):
    """Run one trial; returns (result dict or None, failure text or '')."""
    command = command_for(name, setting, args)
    print(" ".join(command), flush=True)
    began = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    log = args.out_dir / f"{name}.log"
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout or "no output").strip()
        return None, f"exit {done.returncode}: {lines.splitlines()[-1]}"
    result = json.loads((args.out_dir / f"{name}.json").read_text())
    print(f"{name}: {time.time() - began:.0f} s", flush=True)
    return result, ""


def main(argv=None):
    parser = tools.OneLineParser(prog="recipe_sweep.py")
    parser.add_argument("trials", nargs="*", help="setting names, in order")
    parser.add_argument("--list", action="store_true", help="list settings")
    parser.add_argument("--threads", type=tools.count(most=1024), default=2)
    parser.add_argument(
        "--minutes", type=tools.number_from(0.1, 10_000.0), default=15.0
    )
    parser.add_argument("--table", default="results/recipe_sweep.md")
    parser.add_argument("--out-dir", default="results/recipe_sweep")
    args = parser.parse_args(argv)
    args.out_dir = Path(args.out_dir)
    if args.list or not args.trials:
        for name, setting in SETTINGS.items():
            print(f"{name}: {describe(setting)}\n    {setting['why']}")
        return
    unknown = [t for t in args.trials if t not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting {unknown[0]!r}; see --list")
    resumed = [t for t in args.trials if "resume_command" in SETTINGS[t]]
    if resumed:
        parser.error(
            f"{resumed[0]} continues another trial: run its resume_command"
            " by hand, then bench/stopped_trial.py --resumed"
        )
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir} is not a folder")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.trials:
        result, failure = run_trial(name, SETTINGS[name], args)
        append_row(args.table, name, SETTINGS[name], result, failure)


if __name__ == "__main__":
    main()
