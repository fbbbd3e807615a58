"""``taskonce audit``: the Spark audit of event logs (:mod:`taskonce.spark_ext.cli`)."""

from __future__ import annotations

import argparse
from typing import TextIO

NAME = "audit"
HELP = "audit event logs with Spark; recommend keep_for"
PARENTS = ("common",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The audit's options (declaring them imports no Spark)."""
    from taskonce.spark_ext.cli import add_arguments as add_audit_arguments

    add_audit_arguments(parser)


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run the audit."""
    from taskonce.spark_ext.cli import run as run_audit

    return run_audit(args, out)
