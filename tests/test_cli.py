"""The taskonce command: stats, inspect, release, purge, init-db; and the package frame."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import taskonce
from taskonce.cli import main
from tests.helpers import wait_for


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def test_stats_inspect_release_purge_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    assert run("init-db", "--store", url)[0] == 0
    store = taskonce.open_store(url)
    guard = taskonce.Guard(store)
    guard.run("m1", "payments", lambda: None)
    store.mark("payments:old", 0.01, None, None)
    wait_for(lambda: store.get("payments:old") is None, what="the mark to expire")

    code, text = run("stats", "--store", url, "--json")
    assert code == 0
    assert json.loads(text)["completed"] >= 1

    code, text = run("--json", "inspect", "payments:m1", "--store", url)
    assert code == 0 and json.loads(text)["status"] == "completed"
    code, text = run("inspect", "payments:nope", "--store", url)
    assert code == 1 and "no live record" in text

    code, text = run("release", "payments:m1", "--store", url)
    assert code == 0 and "released 'payments:m1'" in text
    assert store.get("payments:m1") is None

    events = tmp_path / "events.jsonl"
    code, text = run("purge", "--store", url, "--json", "--events", str(events))
    assert code == 0 and json.loads(text) == {"deleted": 1}
    assert [e["event"] for e in taskonce.events.read_jsonl(events)] == ["purged"]
    guard.close()


def test_store_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKONCE_STORE", f"sqlite:///{tmp_path}/env.db")
    code, text = run("stats")
    assert code == 0 and f"{tmp_path}/env.db" in text


def test_errors_are_one_clear_line_without_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run("stats", "--store", "redis://:hunter2@127.0.0.1:1/0")
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("taskonce: error: Redis store redis://:***@127.0.0.1:1/0")
    assert "hunter2" not in err
    code, _ = run("stats", "--store", "ftp://x")
    assert code == 2 and "unknown store URL scheme 'ftp'" in capsys.readouterr().err


def test_installed_package_exposes_taskonce_not_core(tmp_path: Path) -> None:
    probe = (
        "import importlib.util, taskonce, taskonce.celery_ext, taskonce.dramatiq_ext, "
        "taskonce.spark_ext; print(importlib.util.find_spec('core') is None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "True"
    assert (Path(taskonce.__file__).parent / "py.typed").exists()
    script = Path(sys.executable).parent / "taskonce"
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "stats", "inspect", "release", "purge", "init-db"):
        assert command in help_text.stdout
