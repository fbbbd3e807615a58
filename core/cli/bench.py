"""``taskonce bench``: bench/store_ops.py of a source checkout, its options handed over
untouched (a wheel has no ``bench/``: the command is not listed there)."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import TextIO

from taskonce.errors import TaskonceError

NAME = "bench"
HELP = "per-operation store latency against raw Redis/SQL calls (bench/store_ops.py)"
PARENTS: tuple[str, ...] = ()


def script() -> Path:
    """bench/store_ops.py of the source checkout this module runs from (a wheel has none)."""
    return Path(__file__).resolve().parents[2] / "bench" / "store_ops.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything after ``bench`` belongs to the script."""
    parser.add_argument(
        "bench_args", nargs=argparse.REMAINDER, help="options of bench/store_ops.py"
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the script with ``args.bench_args``; its exit status."""
    path = script()
    if not path.is_file():
        raise TaskonceError(
            "taskonce bench needs a source checkout: it runs bench/store_ops.py of a clone "
            f"installed with pip install -e . ({path} is not there in this installation)"
        )
    saved, sys.argv = sys.argv, [str(path), *args.bench_args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0
