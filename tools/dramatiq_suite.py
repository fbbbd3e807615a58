"""Dramatiq's own test suite, without and with taskonce's middleware (``make dramatiq-suite``).

Runs the ``tests/`` of a Dramatiq source tree (``--dramatiq-src``: a checkout of the tag of the
installed Dramatiq, see CONTRIBUTING.md) twice, each variant in its own pytest process on its
own redis-server (Dramatiq's Redis fixtures build ``RedisBroker()`` for the default address
and ``FLUSHALL`` it: ``tools/upstream/site/sitecustomize.py`` sends them to that server):

- ``plain``: the brokers as the tests build them;
- ``taskonce``: every broker the tests build (stub, Redis; in pytest and in the ``dramatiq``
  processes the CLI tests start) gets ``IdempotencyMiddleware`` on its own guard, appended
  after Dramatiq's default middleware as a user adds it. The store is a Redis store on the
  variant's server (``--store memory`` for a memory store per broker).

RabbitMQ's tests (``tests/test_rabbitmq.py``) and the benchmarks are left out: they would use
the machine's shared RabbitMQ, and the benchmarks need pytest-benchmark. Memcached's
parametrizations skip unless pylibmc and a memcached server are there.

Prints each variant's counts and the tests failing only with the middleware, with their
reasons; exit status 1 when there is one. The variants run one after the other unless
``--parallel``: Dramatiq's CLI tests write fixed paths in ``/tmp`` (``/tmp/dramatiq-cli-*``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tools.upstream.common import (
    BUILD,
    RedisServer,
    add_run_arguments,
    check_source,
    compare,
)

LEFT_OUT = ("tests/test_rabbitmq.py", "tests/benchmarks")
#: Tests that fail with the middleware because the run adds it, not because of what it does
#: (test id: why); reported apart.
INTENDED = {
    "tests/test_broker.py::test_can_instantiate_brokers_without_middleware": (
        "asserts a broker built with middleware=[] has none; the run appends "
        "IdempotencyMiddleware to every broker built, this one too"
    ),
    "tests/test_redis.py::test_redis_join_race_condition": (
        "counts the queue from inside an actor right after it sent a delayed message; with "
        "taskonce an actor's sends are published after its outcome is recorded (the hand-off), "
        "so the count inside the actor is 2, not 4"
    ),
}


def plain_env(server: RedisServer) -> dict[str, str]:
    """Nothing more: the Redis clients already go to the variant's server."""
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dramatiq-src", type=Path, required=True,
        help="a Dramatiq source tree at the installed version's tag (git clone --branch vX.Y.Z)",
    )  # fmt: skip
    parser.add_argument(
        "tests", nargs="*", default=["tests"],
        help="test files or node ids under the source tree (default: tests)",
    )  # fmt: skip
    parser.add_argument(
        "--store", choices=("redis", "memory"), default="redis",
        help="taskonce's store: database 1 of the variant's redis-server (default), or memory",
    )  # fmt: skip
    parser.add_argument(
        "--parallel", action="store_true",
        help="run both variants at once (by default one after the other: the CLI tests write "
        "fixed files in /tmp that two runs would share)",
    )  # fmt: skip
    add_run_arguments(parser, "Dramatiq", timeout=300, out=BUILD / "dramatiq-suite")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    source = args.dramatiq_src.resolve()
    version = check_source(source, "dramatiq", "tests/conftest.py", args.allow_version_mismatch)

    def taskonce_env(server: RedisServer) -> dict[str, str]:
        store = server.url(1) if args.store == "redis" else "memory://"
        return {"TASKONCE_UPSTREAM_DRAMATIQ_STORE": store}

    # addopts= drops the project's --cov options (pytest-cov is not needed to compare)
    pytest_args = [
        *args.tests, "-q", "-rfE", "--import-mode=append", f"--timeout={args.timeout:g}",
        "-o", "addopts=",
    ]  # fmt: skip
    for path in LEFT_OUT:
        pytest_args += ["--ignore", path]
    return compare(
        args,
        suite=f"Dramatiq {version} tests",
        title=f"Dramatiq {version} tests",
        source=source,
        plain_env=plain_env,
        taskonce_env=taskonce_env,
        pytest_args=pytest_args,
        plugins=["taskonce_upstream_dramatiq"],
        parallel=args.parallel,
        intended=INTENDED,
    )


if __name__ == "__main__":
    raise SystemExit(main())
