"""Variants, their own redis-servers, the pytest runs and the comparison.

Each variant runs in its own pytest process (its own process group, stopped by its id at the
deadline) against its own redis-server on a free loopback port: the frameworks' tests reach
Redis at ``REDIS_HOST:REDIS_PORT`` or at the default address (redirected there by
``site/sitecustomize.py``), so two variants on one server would read and flush each other's
keys. Outcomes come from ``site/taskonce_upstream_results.py``: one JSON line per test phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

logger = logging.getLogger("tools.upstream")

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "site"
BUILD = ROOT / "build" / "upstream"
RESULTS_ENV = "TASKONCE_UPSTREAM_RESULTS"
REDIS_PORT_ENV = "TASKONCE_UPSTREAM_REDIS_PORT"
#: What counts as failing: a failed call, an error in set-up or tear-down, a strict xpass.
FAILING = ("failed", "error")


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of one variant: free loopback port, no persistence, stopped by its pid."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int) -> str:
        """The URL of database ``db`` on this server."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        """Start it and wait (30 s at most) until it answers PING."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--save", "", "--appendonly", "no", "--daemonize", "no",
            "--logfile", str(self.folder / "redis.log"),
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"redis-server on port {self.port} did not start: {self.folder}")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL if it is still there after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)


@dataclasses.dataclass
class Variant:
    """One run of the suite: a name and the environment it adds, given its redis-server."""

    name: str
    env: Callable[[RedisServer], dict[str, str]]


@dataclasses.dataclass
class Outcome:
    """A test's outcome over its phases, and the reason when it did not pass."""

    outcome: str  # passed, failed, error, skipped, xfailed
    reason: str = ""
    #: taskonce's warnings and errors logged during the failing phase
    taskonce_log: list[str] = dataclasses.field(default_factory=list)


def add_run_arguments(
    parser: argparse.ArgumentParser, framework: str, *, timeout: float, out: Path
) -> None:
    """The options both upstream runs take: ``-k``, ``--timeout``, ``--deadline-minutes``,
    ``--allow-version-mismatch`` (of ``framework``'s installed version) and ``--out``."""
    parser.add_argument("-k", dest="keyword", help="run only the tests matching this expression")
    parser.add_argument(
        "--timeout", type=float, default=timeout,
        help=f"seconds a test may take (default {timeout:g})",
    )  # fmt: skip
    parser.add_argument(
        "--deadline-minutes", type=float,
        help="stop a variant's run after this long; the tests finished by then are compared",
    )  # fmt: skip
    parser.add_argument(
        "--allow-version-mismatch", action="store_true",
        help=f"run a source tree of another version than the installed {framework}",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=out)


def source_version(path: Path, package: str) -> str:
    """``__version__`` as written in ``<path>/<package>/__init__.py``."""
    init = path / package / "__init__.py"
    try:
        text = init.read_text(encoding="utf-8")
    except OSError:
        raise SystemExit(f"{init} not found: is {path} a checkout of {package}?") from None
    match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"{init} has no __version__")
    return match.group(1)


def check_source(path: Path, package: str, tests: str, allow_mismatch: bool) -> str:
    """Refuse a source tree without the tests or of another version than the installed one
    (unless ``allow_mismatch``); returns the installed version."""
    if not (path / tests).exists():
        raise SystemExit(f"{path / tests} not found: is {path} a checkout of {package}?")
    installed = metadata.version(package)
    found = source_version(path, package)
    if found != installed:
        message = (
            f"{path} is {package} {found}, the installed {package} is {installed}: check out "
            f"the tag v{installed} (or pass --allow-version-mismatch)"
        )
        if not allow_mismatch:
            raise SystemExit(message)
        logger.warning("%s; running anyway", message)
    return installed


def read_outcomes(path: Path) -> dict[str, Outcome]:
    """Fold the phase lines of one run into one outcome per test."""
    tests: dict[str, Outcome] = {}
    notes: dict[str, list[str]] = {}
    if not path.exists():
        return tests
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            continue  # a line cut by the deadline's kill
        test, when, outcome = line["test"], line["when"], line["outcome"]
        reason = line.get("reason", "")
        if outcome == "rerun":
            continue  # pytest-rerunfailures runs it again: the last attempt decides
        for note in line.get("taskonce_log", []):
            if note not in notes.setdefault(test, []):
                notes[test].append(note)
        current = tests.get(test)
        if outcome == "failed":
            # a failure wins over anything; an error in set-up/tear-down is "error"
            if current is None or current.outcome not in FAILING:
                tests[test] = Outcome("failed" if when == "call" else "error", reason)
        elif outcome == "skipped":
            if current is None or current.outcome == "passed":
                tests[test] = Outcome("xfailed" if line.get("xfail") else "skipped", reason)
        elif when == "call" and (current is None or current.outcome == "passed"):
            tests[test] = Outcome("passed")
        elif current is None and when == "setup":
            tests[test] = Outcome("passed")  # passed so far
    for test, outcome in tests.items():
        if outcome.outcome in FAILING:
            outcome.taskonce_log = notes.get(test, [])
    return tests


def counts(outcomes: dict[str, Outcome]) -> dict[str, int]:
    """How many tests ended in each outcome."""
    result: dict[str, int] = {}
    for outcome in outcomes.values():
        result[outcome.outcome] = result.get(outcome.outcome, 0) + 1
    return dict(sorted(result.items()))


def run_variants(
    *,
    suite: str,
    source: Path,
    variants: Sequence[Variant],
    pytest_args: Sequence[str],
    plugins: Sequence[str],
    out: Path,
    parallel: bool,
    deadline_minutes: float | None,
) -> dict[str, dict[str, Outcome]]:
    """Run every variant (at once with ``parallel``), each on its own redis-server; return
    each variant's outcomes. Logs and result lines go to ``out/<variant>.*``."""
    out = out.resolve()  # redis-server opens its log file after changing to its --dir
    out.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Variant, RedisServer, subprocess.Popen[bytes], Path, float | None]] = []
    results: dict[str, dict[str, Outcome]] = {}
    try:
        for variant in variants:
            server = RedisServer(out / f"{variant.name}-redis")
            server.start()
            results_path = out / f"{variant.name}.jsonl"
            results_path.unlink(missing_ok=True)
            env = dict(os.environ)
            env.update(
                {
                    "PYTHONPATH": os.pathsep.join(
                        [str(SITE)] + [p for p in [env.get("PYTHONPATH")] if p]
                    ),
                    # Dramatiq's reload execs "python -m dramatiq": this interpreter, not the
                    # first python on PATH (a venv not activated would lose its packages)
                    "PATH": os.pathsep.join(
                        [str(Path(sys.executable).parent), env.get("PATH", os.defpath)]
                    ),
                    "REDIS_HOST": "127.0.0.1",
                    "REDIS_PORT": str(server.port),
                    REDIS_PORT_ENV: str(server.port),
                    RESULTS_ENV: str(results_path),
                }
            )
            env.update(variant.env(server))
            command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
            for plugin in ("taskonce_upstream_results", *plugins):
                command += ["-p", plugin]
            command += list(pytest_args)
            log = out / f"{variant.name}.log"
            logger.info(
                "%s %s: redis-server on port %d, log %s", suite, variant.name, server.port, log
            )
            with open(log, "wb") as stream:
                process = subprocess.Popen(
                    command, cwd=source, env=env, stdout=stream, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            deadline = None
            if deadline_minutes is not None:
                deadline = time.monotonic() + deadline_minutes * 60
            started.append((variant, server, process, results_path, deadline))
            if not parallel:
                _wait(process, deadline, variant.name)
                server.stop()
        for variant, server, process, results_path, deadline in started:
            _wait(process, deadline, variant.name)
            server.stop()
            results[variant.name] = read_outcomes(results_path)
    finally:
        for _variant, server, process, _path, _deadline in started:
            _stop_group(process)
            server.stop()
    return results


def _wait(process: subprocess.Popen[bytes], deadline: float | None, name: str) -> None:
    """Wait for ``process``; at the deadline stop its process group (its own session)."""
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s: deadline reached, stopping the run (finished tests count)", name)
        _stop_group(process)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM then SIGKILL the process group this script started (by the pytest's pid)."""
    if process.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=20)
            return
        except subprocess.TimeoutExpired:
            continue


def compare(
    run: argparse.Namespace,
    *,
    suite: str,
    title: str,
    source: Path,
    plain_env: Callable[[RedisServer], dict[str, str]],
    taskonce_env: Callable[[RedisServer], dict[str, str]],
    pytest_args: list[str],
    plugins: list[str],
    parallel: bool,
    intended: Mapping[str, str],
) -> int:
    """Run ``suite`` plain and with taskonce (:func:`run_variants`), then :func:`report` the
    difference under ``title``; the exit status. ``run``: the options of
    :func:`add_run_arguments` (``-k``, ``--out``, ``--deadline-minutes``)."""
    if run.keyword:
        pytest_args = [*pytest_args, "-k", run.keyword]
    results = run_variants(
        suite=suite,
        source=source,
        variants=[Variant("plain", plain_env), Variant("taskonce", taskonce_env)],
        pytest_args=pytest_args,
        plugins=plugins,
        out=run.out,
        parallel=parallel,
        deadline_minutes=run.deadline_minutes,
    )
    return report(title, results, plain="plain", guarded="taskonce", out=run.out, intended=intended)


def report(
    suite: str,
    results: dict[str, dict[str, Outcome]],
    *,
    plain: str,
    guarded: str,
    out: Path,
    intended: Mapping[str, str] | None = None,
) -> int:
    """Print each variant's counts and the tests failing only with taskonce (with their
    reasons), apart from those ``intended`` names (test id: why it fails with taskonce by
    design); write ``out/summary.json``. 0 when no other test fails only with taskonce."""
    intended = intended or {}
    base, other = results.get(plain, {}), results.get(guarded, {})
    failing = _failing_only(other, base)
    only_guarded = [t for t in failing if t not in intended]
    by_design = [t for t in failing if t in intended]
    only_plain = _failing_only(base, other)
    unfinished = sorted(set(base) ^ set(other))
    print(f"== {suite}")
    for name, outcomes in results.items():
        summary = ", ".join(f"{n} {k}" for k, n in counts(outcomes).items()) or "no test ran"
        print(f"{name:>10}: {len(outcomes)} tests: {summary}")
    print(f"failing only with {guarded}: {len(only_guarded)}")
    for test in only_guarded:
        print(f"  {test}\n      {other[test].outcome}: {_first_line(other[test].reason)}")
        for note in other[test].taskonce_log[:2]:
            print(f"      log: {_first_line(note)}")
    if by_design:
        print(f"failing only with {guarded}, by design: {len(by_design)}")
        for test in by_design:
            print(f"  {test}\n      {intended[test]}")
    print(f"failing only with {plain} (flaky, or taskonce made them pass): {len(only_plain)}")
    for test in only_plain:
        print(f"  {test}\n      {base[test].outcome}: {_first_line(base[test].reason)}")
    if unfinished:
        print(f"run in one variant only (deadline, or collection differs): {len(unfinished)}")
    summary_path = out / "summary.json"
    record = {
        "suite": suite,
        "counts": {name: counts(o) for name, o in results.items()},
        f"failing_only_with_{guarded}": {t: dataclasses.asdict(other[t]) for t in only_guarded},
        f"failing_only_with_{guarded}_by_design": {t: intended[t] for t in by_design},
        f"failing_only_with_{plain}": {t: dataclasses.asdict(base[t]) for t in only_plain},
        "run_in_one_variant_only": unfinished,
    }
    summary_path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    print(f"details: {summary_path} and the logs beside it")
    return 1 if only_guarded else 0


def _failing_only(failing: dict[str, Outcome], passing: dict[str, Outcome]) -> list[str]:
    """The tests failing in ``failing`` that passed in ``passing``."""
    return sorted(
        test
        for test, outcome in failing.items()
        if outcome.outcome in FAILING and test in passing and passing[test].outcome == "passed"
    )


def _first_line(text: str) -> str:
    line = next((s for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= 300 else line[:297] + "..."
