"""``taskonce demo``: the duplicate-delivery demo with a real worker."""

from __future__ import annotations

import argparse
from typing import TextIO

NAME = "demo"
HELP = "run the duplicate-delivery demo with a real worker"
PARENTS = ("common",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    parser.add_argument("--framework", choices=("celery", "dramatiq"), default="celery")
    parser.add_argument("--broker", metavar="URL", help="broker URL (default: embedded)")
    parser.add_argument("--count", type=int, default=300, help="charge tasks to send (default 300)")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the demo of ``--framework``; its exit status."""
    if args.framework == "dramatiq":
        from taskonce.demo.dramatiq_demo import run_demo
    else:
        from taskonce.demo.celery_demo import run_demo
    return int(run_demo(store=args.store, broker=args.broker, count=args.count, out=out))
