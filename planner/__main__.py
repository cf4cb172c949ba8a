"""`python -m planner` (the planner.cli package), with Ctrl-C handled from the first line.

The imports below take 0.1-0.5 s (numpy, the planner) before `main` can catch anything: until
they are done, a Ctrl-C ends the process in one line (`planner.startup`). The process's start
is recorded first, so a command's "total" counts the imports too.
"""

import time

from planner.startup import end_guard, guard_start

STARTED = time.time()  # the command's start (before the imports), for its "total" seconds


def _guarded_imports() -> None:
    """Import the command line with Ctrl-C ending the process in one line meanwhile."""
    previous = guard_start()
    import planner.cli
    import planner.cli.output

    planner.cli.output.PROCESS_STARTED = STARTED  # where /proc does not say (process_seconds)
    # from here on a Ctrl-C is a KeyboardInterrupt that the commands handle (or catch_interrupt)
    end_guard(previous)


def console_main() -> None:
    """The `layerwise` console script: `python -m planner` under another name."""
    _guarded_imports()
    from planner.cli import main
    from planner.cli.args import exit_now

    exit_now(main(prog="layerwise"))


if __name__ == "__main__":
    _guarded_imports()
    from planner.cli import main
    from planner.cli.args import exit_now

    exit_now(main())
