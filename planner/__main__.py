"""`python -m planner` (planner/cli.py), with Ctrl-C handled from the first line.

The imports below take 0.1-0.5 s (numpy, the planner) before `main` can catch anything, and
a Ctrl-C during them would print a traceback of importlib frames: until they are done, a
Ctrl-C ends the process with the one line every interrupted command prints and status 130.
The process's start is recorded first, so a command's "total" counts the imports too.
"""

import os
import signal
import time

STARTED = time.time()  # the command's start (before the imports), for its "total" seconds


def _interrupted_while_starting(signum: int, frame: object) -> None:
    os.write(2, b"error: interrupted\n")
    os._exit(130)


def _guarded_imports() -> None:
    """Import the command line with Ctrl-C ending the process in one line meanwhile."""
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting)
    import planner.cli

    planner.cli.PROCESS_STARTED = STARTED  # where /proc does not say (process_seconds)
    # from here on a Ctrl-C is a KeyboardInterrupt that the commands handle (or catch_interrupt)
    signal.signal(signal.SIGINT, previous)


def console_main() -> None:
    """The `layerwise` console script: `python -m planner` under another name."""
    _guarded_imports()
    from planner.cli import exit_now, main

    exit_now(main(prog="layerwise"))


if __name__ == "__main__":
    _guarded_imports()
    from planner.cli import exit_now, main

    exit_now(main())
