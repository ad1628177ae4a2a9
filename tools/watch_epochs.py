"""Print a line each time a training run saves an epoch file, until stopped.

`make notebook` runs this beside notebook 03, whose training prints only
into the notebook: without it, the terminal would show nothing for the
7 to 22 minutes that the training takes on a CPU.
"""

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path

EPOCH_FILE = re.compile(r"epoch_(\d+)\.pt")  # as the training names them


def saved_since(folder, start, reported):
    """The epoch files in `folder` written at or after `start` (a time in
    seconds) and not in `reported`, in epoch order."""
    found = []
    for path in sorted(Path(folder).glob("epoch_*.pt")):
        if not EPOCH_FILE.fullmatch(path.name) or path.name in reported:
            continue
        try:
            written = path.stat().st_mtime
        except OSError:  # deleted since: the run keeps only the last few
            continue
        if written >= start:
            found.append(path)
    return found


def epoch_line(path, epochs):
    """ "  epoch 3 of 5 saved (14:02)" for epoch_002.pt: files count from 0."""
    number = int(EPOCH_FILE.fullmatch(path.name).group(1)) + 1
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
    if not Path("/proc").is_dir():  # a Mac: os.kill's answer is all
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it ended between the two looks
        return False
    return "State:\tZ" not in status


def report_new(folder, start, reported, epochs):
    """Print a line for each epoch file saved since the last look."""
    for path in saved_since(folder, start, reported):
        reported.add(path.name)
        print(epoch_line(path, epochs), flush=True)


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

    def last_look(signum, frame):
        """Killed by make once the notebook ends: a last look, then exit
        quietly (a shell reports a job that a signal ended)."""
        report_new(args.folder, start, reported, args.epochs)
        sys.exit(0)

    signal.signal(signal.SIGTERM, last_look)
    # Started with `&` by make's shell, it ignores Ctrl-C; so it stops
    # when that shell is gone (Ctrl-C ends make), if not killed before.
    try:
        while args.while_running is None or is_running(args.while_running):
            time.sleep(args.every)
            report_new(args.folder, start, reported, args.epochs)
    except KeyboardInterrupt:  # Ctrl-C, when run by hand
        pass


if __name__ == "__main__":
    main()
