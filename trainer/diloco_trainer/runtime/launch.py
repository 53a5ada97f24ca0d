"""`--exec-prefix NAME=COMMAND`: start a supervised child under a command, e.g. in a network namespace of its own.

`diloco local` and `diloco baseline` take it; the WAN benchmark (bench/diloco_bench/wan.py) uses it to run every
learner behind an emulated slow link (`ip netns exec NS ...`).
"""

from __future__ import annotations

import argparse
import shlex


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--exec-prefix", action="append", default=[], metavar="NAME=COMMAND",
                        help="start child NAME (learner-0, ..., syncer) as COMMAND followed by its own command line, "
                             "e.g. learner-0='ip netns exec ns0' (repeatable; the WAN benchmark's namespaces)")


def parse_exec_prefixes(items: list[str], names: list[str]) -> dict[str, list[str]]:
    """NAME=COMMAND items as {name: argv prefix}; only known names, each at most once, a non-empty command."""
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, command = item.partition("=")
        name = name.strip()
        if not sep or not command.strip():
            raise ValueError(f"--exec-prefix {item!r}: expected NAME=COMMAND")
        if name not in names:
            raise ValueError(f"--exec-prefix {item!r}: no child named {name!r} (children: {', '.join(names)})")
        if name in out:
            raise ValueError(f"--exec-prefix: {name!r} given twice")
        out[name] = shlex.split(command)
    return out
