"""``taskonce release``: an operator's release of one key's record."""

from __future__ import annotations

import argparse
from typing import TextIO

from taskonce.cli.output import answer, not_found
from taskonce.cli.store import key_of, open_existing
from taskonce.exits import EXIT_OK

NAME = "release"
HELP = "delete one key's record (an operator's release)"
PARENTS = ("common", "store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """KEY."""
    parser.add_argument("key", metavar="KEY")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Delete KEY's record, whatever its state."""
    key = key_of(args)
    with open_existing(args, read_only=False) as store:
        existed = store.get(key) is not None
        store.release(key, None)
        data = {"key": key, "released": existed}
        if not existed:
            human = f"no live record for key {key!r}: nothing released"
            return not_found(out, args, store, key, data, human)
        answer(out, args, data, f"released {key!r}")
    return EXIT_OK
