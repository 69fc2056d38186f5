"""The ``conduit`` console script's entry: Ctrl-C while Conduit (and torch) are still loading ends quietly too.

It lives outside the ``conduit`` package on purpose: importing anything inside the package runs the package's
``__init__`` first, which loads torch (a second or more), and a Ctrl-C landing there would be raised before
:func:`conduit.cli.main` could catch it, as a traceback from deep inside torch's import.
"""

from __future__ import annotations

import sys

#: the exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports a process it interrupted);
#: defined here, torch-free, and imported by :mod:`conduit.cli`, so both exits report the same status
INTERRUPTED = 130


def main() -> int:
    """Load the command line and run it (:func:`conduit.cli.main`); Ctrl-C while loading says so in one line."""
    try:
        from conduit.cli import main as run
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C) while conduit was starting; nothing was run.", file=sys.stderr)
        return INTERRUPTED
    return run()
