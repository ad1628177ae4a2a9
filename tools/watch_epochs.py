"""Print a line each time a training run saves an epoch file, until stopped.

`make notebook` runs this beside notebook 03, whose training prints only
into the notebook: without it, the terminal would show nothing for the
10 to 22 minutes that the training takes on a CPU.
"""

import argparse
import os
import re
import time
from pathlib import Path


def saved_since(folder, start, reported):
    """The epoch files in `folder` written at or after `start` (a time in
    seconds) and not in `reported`, in epoch order."""
    found = sorted(Path(folder).glob("epoch_*.pt"))
    return [
        path
        for path in found
        if path.name not in reported and path.stat().st_mtime >= start
    ]


def epoch_line(path, epochs):
    """ "  epoch 3 of 5 saved (14:02)" for epoch_002.pt: files count from 0."""
    number = int(re.search(r"\d+", path.name).group()) + 1
    return f"  epoch {number} of {epochs} saved ({time.strftime('%H:%M')})"


def is_running(pid):
    """Whether process `pid` exists and has not ended (a zombie, ended
    but not yet collected by its parent, counts as ended)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the run's checkpoint folder")
    parser.add_argument(
        "--epochs", type=int, default=5, help="the run's epochs (default 5)"
    )
    parser.add_argument(
        "--every", type=float, default=10.0, help="seconds between looks"
    )
    parser.add_argument(
        "--while-running",
        type=int,
        metavar="PID",
        help="stop once process PID has ended (make passes its shell's)",
    )
    args = parser.parse_args(argv)
    start = time.time() - 1  # file times may be rounded down
    reported = set()
    # Started with `&` by make's shell, it ignores Ctrl-C; so it stops
    # when that shell is gone (Ctrl-C ends make), if not killed before.
    try:
        while args.while_running is None or is_running(args.while_running):
            time.sleep(args.every)
            for path in saved_since(args.folder, start, reported):
                reported.add(path.name)
                print(epoch_line(path, args.epochs), flush=True)
    except KeyboardInterrupt:  # Ctrl-C, when run by hand
        pass


if __name__ == "__main__":
    main()
