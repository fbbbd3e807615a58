"""The version matrix: the suite's version-sensitive subset in fresh virtualenvs, once with every
runtime dependency at the lowest version ``pyproject.toml`` admits (*lowest*) and once with the
newest releases (*newest*), for each Python interpreter asked for.

``make matrix`` runs both sessions; ``make matrix-lowest`` (CI, after ``make test``) the first::

    python -m tools.matrix                           # lowest and newest, this machine's python3.11
    python -m tools.matrix --session lowest          # one session
    python -m tools.matrix --python python3.11 --python python3.12   # more interpreters
    MATRIX_PYTHONS="python3.11 python3.13" python -m tools.matrix      # the same, by environment
    python -m tools.matrix --install-only            # build the virtualenvs, run nothing

*lowest* pins each requirement of the runtime extras (``redis``, ``sql``, ``celery``,
``dramatiq``, ``spark``, ``prometheus``, ``otel``, ``django``), and Django's Dramatiq binding,
to its ``>=`` bound (``LOWEST_ALSO``); what those pull in is resolved as usual, as a user's
installer would. *newest* installs ``.[all,dev,sqs]`` with nothing pinned. Each session
prints the versions it tested, writes them to ``build/matrix/<session>-<python>.json`` and runs
``SELECTION`` with pytest in its own virtualenv (worker subprocesses inherit that interpreter).

uv builds the virtualenvs when it is installed (``pip install uv``; ten times faster), pip
otherwise. The services are the suite's (``.ci/services``). Exit status: 0 when every session
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "matrix"

#: The extras whose requirements are runtime dependencies (``all`` and ``dev`` are not).
RUNTIME_EXTRAS = ("redis", "sql", "celery", "dramatiq", "spark", "prometheus", "otel", "django")
#: Also pinned low in *lowest*: a dev requirement that is a user's runtime dependency too
#: (docs/django.md's Django + Dramatiq pairing).
LOWEST_ALSO = ("django-dramatiq",)

#: What each session runs (pytest node ids, from the repository root), about 5 minutes at
#: ``-n 3`` on a 2-CPU machine: the store contract on every store (redis-py, SQLAlchemy and the
#: drivers), the guard, the event sinks (prometheus-client, OpenTelemetry), a real worker per
#: framework and broker (a duplicate and a SIGKILL; each Celery test runs on Redis and RabbitMQ
#: brokers, each Dramatiq one on both), the Django project's real-worker tests and the audit
#: of the worked example (PySpark).
SELECTION = (
    "tests/test_store_contract.py",
    "tests/test_store_urls.py",
    "tests/test_compat.py",
    "tests/test_guard.py",
    "tests/test_transactional.py",
    "tests/metrics/test_sinks.py",
    "tests/celery/test_worker.py::test_duplicate_on_the_wire_runs_once",
    "tests/celery/test_worker.py::test_worker_child_killed_mid_task_is_taken_over_and_runs_again",
    "tests/dramatiq/test_worker.py::test_duplicate_on_the_wire_runs_once",
    "tests/dramatiq/test_crash.py",
    "tests/django/test_celery_workers.py",
    "tests/django/test_dramatiq_workers.py",
    "tests/spark/test_audit_worked.py",
)

#: The packages whose versions a session reports (the runtime dependencies and the brokers'
#: client libraries they bring).
REPORTED = (
    "celery", "kombu", "amqp", "billiard", "dramatiq", "pika", "django", "django-dramatiq",
    "redis", "hiredis", "sqlalchemy", "psycopg", "psycopg-binary", "pymysql", "pyspark",
    "matplotlib", "numpy", "prometheus-client", "opentelemetry-api", "boto3", "pycurl",
)  # fmt: skip


def lowest_pins(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """``name==version`` for every ``name>=version`` of the runtime extras and ``LOWEST_ALSO``
    (extras and markers dropped: the pin constrains the distribution itself)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    requirements = [req for extra in RUNTIME_EXTRAS for req in extras.get(extra, [])]
    requirements += [req for req in extras.get("dev", []) if _name(req) in LOWEST_ALSO]
    pins: dict[str, str] = {}
    for requirement in requirements:
        match = re.search(r">=\s*([\w.]+)", requirement)
        if match is None:
            continue
        name = _name(requirement)
        if name in pins and pins[name] != match.group(1):
            raise SystemExit(
                f"pyproject.toml gives {name} two lower bounds: {pins[name]} and {match.group(1)}"
            )
        pins[name] = match.group(1)
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def _name(requirement: str) -> str:
    """The normalised distribution name a requirement string starts with."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match is not None, requirement
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def find_uv() -> str | None:
    """uv beside this interpreter (``pip install uv`` into the project's venv) or on PATH."""
    beside = Path(sys.executable).with_name("uv")
    return str(beside) if beside.exists() else shutil.which("uv")


def run(command: list[str], **kwargs: object) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, **kwargs)  # type: ignore[call-overload]


def build(session: str, python: str, venv: Path) -> None:
    """A fresh virtualenv at ``venv`` with taskonce (editable) and this session's versions."""
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    # The sqs extra only in *newest*: its lowest kombu (5.3.1) is not the celery extra's (5.3.0).
    target = [".[all,dev]" if session == "lowest" else ".[all,dev,sqs]"]
    constraints: list[str] = []
    if session == "lowest":
        pins = venv.parent / f"{venv.name}-constraints.txt"
        pins.write_text("\n".join(lowest_pins()) + "\n")
        print(f"{session}: pinned to the lower bounds:\n  " + "\n  ".join(lowest_pins()))
        constraints = ["-c", str(pins)]
    uv = find_uv()
    if uv:
        run([uv, "venv", "--quiet", "--seed", "--python", python, str(venv)])
        run([uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
             *constraints, "-e", *target])  # fmt: skip
    else:
        run([python, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
        run([*pip, "--upgrade", "pip"])
        run([*pip, *constraints, "-e", *target])


def versions(venv: Path) -> dict[str, str]:
    """The installed version of each ``REPORTED`` package in ``venv`` (absent ones left out)."""
    script = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "out['python'] = sys.version.split()[0]\n"
        "print(json.dumps(out))\n"
    )
    answer = subprocess.run(
        [str(venv / "bin" / "python"), "-c", script, *REPORTED],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    found: dict[str, str] = json.loads(answer.stdout)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--session", action="append", choices=("lowest", "newest"))
    parser.add_argument(
        "--python", action="append",
        help="an interpreter (name on PATH or path); repeat for more. Default: $MATRIX_PYTHONS "
        "or python3.11",
    )  # fmt: skip
    parser.add_argument("--install-only", action="store_true")
    parser.add_argument("--processes", default=os.environ.get("TEST_PROCESSES", "3"))
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    sessions = args.session or ["lowest", "newest"]
    pythons = args.python or os.environ.get("MATRIX_PYTHONS", "python3.11").split()
    results: list[tuple[str, str, str, float, float]] = []
    for python in pythons:
        for session in sessions:
            label = f"{session}-{Path(python).name}"
            venv = BUILD / label
            started = time.monotonic()
            outcome = "passed"
            test_seconds = 0.0
            try:
                build(session, python, venv)
                found = versions(venv)
                (BUILD / f"{label}.json").write_text(json.dumps(found, indent=2) + "\n")
                print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
                if not args.install_only:
                    tests_started = time.monotonic()
                    command = [
                        str(venv / "bin" / "python"), "-m", "pytest", "-q", "-ra",
                        "-p", "no:cacheprovider", "-n", str(args.processes),
                        "--dist", "loadfile", "--durations=10", *SELECTION, *args.pytest_args,
                    ]  # fmt: skip
                    print("+", " ".join(command), flush=True)
                    status = subprocess.run(command, cwd=ROOT).returncode
                    test_seconds = time.monotonic() - tests_started
                    if status != 0:
                        outcome = f"FAILED (pytest exit {status})"
            except subprocess.CalledProcessError as exc:
                outcome = f"FAILED to install (exit {exc.returncode})"
            results.append((label, outcome, python, time.monotonic() - started, test_seconds))
    print("\nmatrix:")
    for label, outcome, _python, total, tests in results:
        print(f"  {label:24} {outcome:32} {total:6.0f} s (tests {tests:.0f} s)")
    return 0 if all(outcome == "passed" for _, outcome, *_ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
