"""The ``conduit`` command line.

``conduit demo`` runs the main job: the demo an installed adapter registers under the
``conduit.demos`` entry-point group (conduit-rllib registers DQN), or the synthetic
actor/learner loop of conduit-core with ``--synthetic`` or when no adapter registers one.
Other subcommands are registered the same way under ``conduit.commands``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from conduit_entry import INTERRUPTED  # the exit status of Ctrl-C (130), shared with the console script's entry

from conduit.errors import ConduitError

__all__ = ["INTERRUPTED", "main"]

#: ``register(subparsers)`` adds one subcommand whose handler is ``args.func(args) -> int``
Registrar = Callable[[argparse._SubParsersAction], None]  # type: ignore[type-arg]


def _demo(args: argparse.Namespace) -> int:
    if not args.synthetic:
        demos = sorted(entry_points(group="conduit.demos"), key=lambda e: e.name)
        if demos:
            if {"-h", "--help"} & set(args.rest):  # the adapter's parser prints its own options only
                print(f"conduit demo runs {demos[0].name}'s demo (its options below); `conduit demo --synthetic "
                      f"[--help]` runs core's synthetic actor/learner loop instead.\n")
            run = demos[0].load()
            return int(run(args.rest) or 0)
        # core alone: say so, or the RLlib demo's options read as unknown options of a command never typed
        print("conduit demo: no adapter demo is installed (conduit-rllib registers the RLlib DQN demo: pip install "
              "conduit-rllib); running core's synthetic actor/learner loop, `conduit demo --synthetic`, instead.",
              file=sys.stderr)
    from conduit.demo import run_synthetic

    return run_synthetic(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conduit", description="Conduit: an Experience Data Plane for RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job and print where the experience-path time went",
                          add_help=False)
    demo.add_argument("--synthetic", action="store_true", help="run core's synthetic loop, not an adapter's")
    demo.set_defaults(func=_demo)
    from conduit import commands

    commands.register(sub)
    for ep in sorted(entry_points(group="conduit.commands"), key=lambda e: e.name):
        ep.load()(sub)
    for sp in sub.choices.values():  # the subcommand's parser refuses what it does not know, with its own usage
        sp.set_defaults(command_parser=sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``conduit`` command; its exit status.

    0 when it finished, 2 for a refused argument or configuration (one ``error:`` line on stderr), 1 when the
    output's reader went away, :data:`INTERRUPTED` (130) when Ctrl-C stopped it (one line on stderr, no
    traceback; the command's own cleanup -- closing its buffer, removing a half-written file -- has run).
    """
    try:
        parser = build_parser()
        args, rest = parser.parse_known_args(argv)
        if args.command == "demo":
            args.rest = rest
        elif rest:  # said by the subcommand's parser (its usage lists the options it takes), not the top level's
            getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(rest)}")
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that went away shows up here, not as a traceback at interpreter exit
        return rc
    except ConduitError as e:  # every subcommand: a refused argument or configuration, said without a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the output was piped into a reader that stopped early (`conduit ... | head`)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, quietly
        os.close(devnull)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the command's `finally`s have run on the way here; say so in one line
        print("interrupted (Ctrl-C): the command stopped before it finished; outputs it had not written yet are "
              "missing.", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
