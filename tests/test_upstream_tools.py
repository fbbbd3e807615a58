"""The tooling that runs the frameworks' own suites against taskonce (``tools/upstream``):
how a run's phase lines fold into outcomes, what the comparison reports, and the process-wide
patches of ``tools/upstream/site`` in a real Python process on a real redis-server of its own.
The suites themselves (``make celery-canvas``, ``make dramatiq-suite``) are not run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.helpers import IN_CI
from tools.upstream.common import SITE, Outcome, RedisServer, read_outcomes, report


def _lines(path: Path, *phases: tuple[str, str, str]) -> Path:
    with open(path, "w", encoding="utf-8") as out:
        for test, when, outcome in phases:
            line = {"test": test, "when": when, "outcome": outcome}
            if outcome != "passed":
                line["reason"] = f"{test} {when} went {outcome}\nsecond line"
            if test == "fails" and when == "call":  # the subtest failed, its test logged
                line["taskonce_log"] = [f"ERROR taskonce {test} {outcome}"]
            if outcome == "xfail":
                line.update(outcome="skipped", xfail=True)
            out.write(json.dumps(line) + "\n")
        out.write('{"test": "cut-by-the-deadline", "wh')  # a kill mid-write
    return path


def test_phases_fold_into_one_outcome_per_test(tmp_path: Path) -> None:
    path = _lines(
        tmp_path / "run.jsonl",
        ("ok", "setup", "passed"), ("ok", "call", "passed"), ("ok", "teardown", "passed"),
        ("fails", "setup", "passed"), ("fails", "call", "failed"),
        ("fails", "call", "passed"), ("fails", "teardown", "passed"),
        ("teardown-error", "setup", "passed"), ("teardown-error", "call", "passed"),
        ("teardown-error", "teardown", "failed"),
        ("setup-error", "setup", "failed"), ("setup-error", "teardown", "passed"),
        ("skipped", "setup", "skipped"), ("skipped", "teardown", "passed"),
        ("xfailed", "setup", "passed"), ("xfailed", "call", "xfail"),
        ("rerun-then-pass", "setup", "passed"), ("rerun-then-pass", "call", "rerun"),
        ("rerun-then-pass", "setup", "passed"), ("rerun-then-pass", "call", "passed"),
    )  # fmt: skip
    outcomes = {test: o.outcome for test, o in read_outcomes(path).items()}
    assert outcomes == {
        "ok": "passed",
        "fails": "failed",
        "teardown-error": "error",
        "setup-error": "error",
        "skipped": "skipped",
        "xfailed": "xfailed",
        "rerun-then-pass": "passed",
    }
    assert read_outcomes(path)["fails"].reason.startswith("fails call went failed")
    assert read_outcomes(path)["fails"].taskonce_log == [
        "ERROR taskonce fails failed",
        "ERROR taskonce fails passed",
    ]
    assert read_outcomes(path)["ok"].taskonce_log == []


def test_report_lists_the_tests_failing_only_with_taskonce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {
        "plain": {
            "a": Outcome("passed"),
            "b": Outcome("passed"),
            "c": Outcome("failed", "upstream bug"),
            "d": Outcome("passed"),
            "e": Outcome("failed", "flaky"),
        },
        "taskonce": {
            "a": Outcome("passed"),
            "b": Outcome("failed", "TimeoutError\nmore", ["ERROR taskonce x refused, not run"]),
            "c": Outcome("failed", "upstream bug"),
            "d": Outcome("error", "by design"),
            "e": Outcome("passed"),
        },
    }
    status = report(
        "suite", results, plain="plain", guarded="taskonce", out=tmp_path,
        intended={"d": "the run adds the middleware"},
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 1
    assert "     plain: 5 tests: 2 failed, 3 passed" in printed
    assert "  taskonce: 5 tests: 1 error, 2 failed, 2 passed" in printed
    assert (
        "failing only with taskonce: 1\n  b\n      failed: TimeoutError\n"
        "      log: ERROR taskonce x refused, not run\n"
    ) in printed
    assert "failing only with taskonce, by design: 1\n  d\n      the run adds the middleware" in (
        printed
    )
    assert "failing only with plain (flaky, or taskonce made them pass): 1\n  e\n" in printed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["failing_only_with_taskonce"]) == ["b"]
    assert summary["failing_only_with_taskonce_by_design"] == {"d": "the run adds the middleware"}

    del results["taskonce"]["b"]  # none left but the intended one: success
    assert report("suite", results, plain="plain", guarded="taskonce", out=tmp_path,
                  intended={"d": "x"}) == 0  # fmt: skip


def test_site_patches_reach_a_new_process_on_the_variants_own_server(tmp_path: Path) -> None:
    """A process started with the variant's environment (as Dramatiq's CLI tests start
    ``python -m dramatiq``): a Redis client of the default address lands on the variant's
    server, and a broker it builds carries IdempotencyMiddleware, after Retries."""
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        env = dict(
            os.environ,
            PYTHONPATH=str(SITE),
            TASKONCE_UPSTREAM_REDIS_PORT=str(server.port),
            TASKONCE_UPSTREAM_DRAMATIQ_STORE=server.url(1),
        )
        program = (
            "import redis\n"
            "from dramatiq.brokers.redis import RedisBroker\n"
            "from dramatiq.brokers.stub import StubBroker\n"
            "redis.Redis().set('upstream-probe', 'here')\n"
            "for broker in (StubBroker(), RedisBroker()):\n"
            "    print(','.join(type(m).__name__ for m in broker.middleware))\n"
            "    broker.close()\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        for names in done.stdout.split():
            stack = names.split(",")
            assert stack[-1] == "IdempotencyMiddleware"
            assert stack.index("Retries") < stack.index("IdempotencyMiddleware")
        assert len(done.stdout.split()) == 2
        with redis.Redis(port=server.port, socket_timeout=5) as client:
            assert client.get("upstream-probe") == b"here"
    finally:
        server.stop()
    assert server.process is not None and server.process.poll() is not None
