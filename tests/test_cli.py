"""The taskonce command: stats, inspect, release, purge, init-db; and the package frame."""

from __future__ import annotations

import datetime
import io
import json
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import taskonce
from taskonce.cli import main
from taskonce.cli.output import duration_in_words
from tests.helpers import (
    POSTGRES_URL,
    REDIS_URL,
    STORE_KINDS,
    drop_store,
    make_store,
    require_service,
    wait_for,
)


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
    (purged,) = taskonce.events.read_jsonl(events)
    assert (purged["count"], purged["reason"]) == (1, "expired")  # not None
    assert purged["keep_for_s"] is not None and purged["worker"] is not None
    guard.close()


def test_store_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TASKONCE_STORE", f"sqlite:///{tmp_path}/env.db")
    assert run("init-db")[0] == 0
    code, text = run("stats")
    assert code == 0 and f"{tmp_path}/env.db" in text


def test_read_only_commands_never_create_the_default_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TASKONCE_STORE", raising=False)
    for argv in (["stats"], ["inspect", "payments:m1"], ["release", "payments:m1"], ["purge"]):
        code, text = run(*argv)
        err = capsys.readouterr().err
        assert code == 2 and text == ""
        assert "no --store or TASKONCE_STORE given; using sqlite:///taskonce.db" in err
        assert f"no store at sqlite:///taskonce.db: {tmp_path}/taskonce.db does not exist" in err
        assert list(tmp_path.iterdir()) == []


def test_default_store_is_named_and_read_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TASKONCE_STORE", raising=False)
    assert run("init-db")[0] == 0
    store = taskonce.open_store(f"sqlite:///{tmp_path}/taskonce.db")
    taskonce.Guard(store).run("m1", "payments", lambda: None)
    store.close()
    capsys.readouterr()
    before = (tmp_path / "taskonce.db").read_bytes()
    code, text = run("stats", "--json")
    assert code == 0 and json.loads(text)["completed"] == 1
    assert f"using sqlite:///taskonce.db ({tmp_path}/taskonce.db)" in capsys.readouterr().err
    assert run("inspect", "payments:m1")[0] == 0
    assert (tmp_path / "taskonce.db").read_bytes() == before
    capsys.readouterr()
    # with a store named, nothing is said on stderr
    assert run("stats", "--store", f"sqlite:///{tmp_path}/taskonce.db")[0] == 0
    assert capsys.readouterr().err == ""


def test_read_only_commands_do_not_create_a_table(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/other.db"
    sqlite3.connect(tmp_path / "other.db").close()  # a database without taskonce's table
    code, _ = run("stats", "--store", url)
    assert code == 2
    with sqlite3.connect(tmp_path / "other.db") as connection:
        assert connection.execute("SELECT name FROM sqlite_master").fetchall() == []


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
        "import importlib.util as u, taskonce, taskonce.celery_ext, taskonce.dramatiq_ext, "
        "taskonce.spark_ext, taskonce.demo.celery_demo, taskonce.demo.dramatiq_demo; "
        "print([u.find_spec(m) is None for m in ('core', 'demo')], "
        "[u.find_spec(f'taskonce.{e}.{m}') is None for e in ('celery_ext', 'dramatiq_ext') "
        "for m in ('demo', 'demo_app')])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    # no top-level core or demo module; the demos live in taskonce.demo, not in the adapters
    assert result.stdout.strip() == "[True, True] [True, True, True, True]"
    assert (Path(taskonce.__file__).parent / "py.typed").exists()
    script = Path(sys.executable).parent / "taskonce"
    help_text = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "stats", "inspect", "release", "purge", "init-db"):
        assert command in help_text.stdout


# -- namespaces, queues, times (--prefix, --table, --queue, --utc) -------------------------------


def _fill(url: str, **options: str) -> None:
    """payments: one eager completion and one lazy mark; mail:box: one lazy mark and a claim."""
    store = taskonce.open_store(url, **options)
    lazy = taskonce.Policy(mode="lazy")
    taskonce.Guard(store).run("m1", "payments", lambda: 5)
    taskonce.Guard(store, default=lazy).run("m2", "payments", lambda: None)
    taskonce.Guard(store, default=lazy).run("m3", "mail:box", lambda: None)
    store.claim("mail%3Abox:m4", "worker-1", 300, 60, None)
    store.close()


def test_stats_per_queue_with_marked_apart_from_completed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    _fill(url, table="jobs")
    code, text = run("stats", "--store", url, "--table", "jobs")
    assert code == 0
    lines = text.splitlines()
    assert lines[0] == f"SQLStore {url} (table jobs)"
    assert lines[1].split() == [
        "queue",
        "keys",
        "claimed",
        "completed",
        "marked",
        "quarantined",
        "unsent",
        "receipts",
    ]
    assert [line.split() for line in lines[2:5]] == [
        ["mail:box", "2", "1", "0", "1", "0", "0", "0"],
        ["payments", "2", "0", "1", "1", "0", "0", "0"],
        ["all", "4", "1", "1", "2", "0", "0", "0"],
    ]
    code, text = run("stats", "--store", url, "--table", "jobs", "--json")
    data = json.loads(text)
    assert (data["keys"], data["in_progress"], data["completed"], data["marked"]) == (4, 1, 1, 2)
    assert data["queues"]["payments"] == {
        "keys": 2,
        "in_progress": 0,
        "completed": 1,
        "marked": 1,
        "quarantined": 0,
        "sends_pending": 0,
        "receipts": 0,
    }
    code, text = run("stats", "--store", url, "--table", "jobs", "--queue", "mail:box", "--json")
    data = json.loads(text)
    assert data["queue"] == "mail:box" and list(data["queues"]) == ["mail:box"]
    assert (data["keys"], data["in_progress"], data["marked"]) == (2, 1, 1)
    # the default table is another store: nothing there
    assert run("stats", "--store", url)[0] == 2


def test_a_quarantined_key_in_stats_inspect_and_release(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    store = taskonce.open_store(url)
    store.claim("payments:m9", "w1", 300, 60, "fp", "host/1/2/3")
    assert store.take_over("payments:m9", "w1", "w2", 300, 60, "host/1/2/4") == 1
    store.quarantine("payments:m9", "w2", 3600)
    store.close()
    code, text = run("stats", "--store", url)
    assert code == 0 and text.splitlines()[2].split() == [
        "payments", "1", "0", "0", "0", "1", "0", "0"
    ]  # fmt: skip
    assert json.loads(run("stats", "--store", url, "--json")[1])["quarantined"] == 1
    code, text = run("inspect", "payments:m9", "--store", url)
    assert code == 0 and "state        quarantined" in text
    assert "take-overs   1 (from dead owners)" in text
    data = json.loads(run("inspect", "payments:m9", "--store", url, "--json")[1])
    assert (data["state"], data["status"], data["crashes"]) == ("quarantined", "quarantined", 1)
    assert run("release", "payments:m9", "--store", url) == (0, "released 'payments:m9'\n")
    assert run("inspect", "payments:m9", "--store", url)[0] == 1


def test_inspect_and_release_a_message_id_on_a_queue(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    _fill(url, table="jobs")
    code, text = run("inspect", "m4", "--queue", "mail:box", "--store", url, "--table", "jobs")
    assert code == 0
    assert "key          mail%3Abox:m4" in text and "state        claimed" in text
    assert "queue        mail:box" in text and "owner        worker-1" in text
    for key, state in (("m1", "completed"), ("m2", "marked")):
        args = ("inspect", key, "--queue", "payments", "--store", url, "--table", "jobs")
        assert f"state        {state}\n" in run(*args)[1]
        assert json.loads(run(*args, "--json")[1])["state"] == state
    code, text = run("release", "m1", "--queue", "payments", "--store", url, "--table", "jobs")
    assert code == 0 and text == "released 'payments:m1'\n"
    assert run("inspect", "payments:m1", "--store", url, "--table", "jobs")[0] == 1


def test_times_are_iso_8601_local_or_utc_and_durations_in_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/q.db"
    _fill(url)
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    try:
        text = run("inspect", "mail%3Abox:m4", "--store", url)[1]
        local = {line[:12].strip(): line[13:] for line in text.splitlines()}
        utc = run("inspect", "mail%3Abox:m4", "--store", url, "--utc")[1]
        raw = json.loads(run("inspect", "mail%3Abox:m4", "--store", url, "--json")[1])
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    created = datetime.datetime.fromisoformat(local["created"])
    assert local["created"].endswith("+05:30") and local["kept until"].endswith("+05:30")
    assert created.timestamp() == pytest.approx(raw["created_at"], abs=1)
    assert re.search(r"^created\s+\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", utc, re.M)
    assert re.fullmatch(r"4 min \d\d? s|5 min", local["lease left"])
    # --json keeps the raw numbers: seconds since the epoch and seconds
    assert isinstance(raw["created_at"], float) and 290 < raw["lease_remaining"] <= 300


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (252, "4 min 12 s"),
        (0.85, "850 ms"),
        (0, "0 ms"),
        (59.6, "1 min"),
        (3605, "1 h 5 s"),
        (6 * 86400 + 23 * 3600 + 59, "6 d 23 h"),
    ],
)
def test_durations_in_words(seconds: float, words: str) -> None:
    assert duration_in_words(seconds) == words


def test_prefix_selects_the_redis_namespace() -> None:
    require_service("redis")
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    _fill(REDIS_URL, prefix=prefix)
    try:
        code, text = run("stats", "--store", REDIS_URL, "--prefix", prefix, "--json")
        data = json.loads(text)
        assert code == 0 and (data["keys"], data["completed"], data["marked"]) == (4, 1, 2)
        assert data["store"].endswith(f"prefix={prefix}")
        code, text = run(
            "inspect", "m2", "--queue", "payments", "--store", REDIS_URL, "--prefix", prefix
        )
        assert code == 0 and "state        marked" in text
        assert run("release", "payments:m2", "--store", REDIS_URL, "--prefix", prefix)[0] == 0
        assert run("inspect", "payments:m2", "--store", REDIS_URL, "--prefix", prefix)[0] == 1
    finally:
        drop_store(taskonce.open_store(REDIS_URL, prefix=prefix))


def test_table_selects_the_sql_table_on_postgresql() -> None:
    require_service("postgresql")
    table = f"cli_{uuid.uuid4().hex[:8]}"
    assert run("init-db", "--store", POSTGRES_URL, "--table", table)[0] == 0
    try:
        _fill(POSTGRES_URL, table=table)
        code, text = run("stats", "--store", POSTGRES_URL, "--table", table, "--queue", "payments")
        assert code == 0 and text.splitlines()[2].split() == [
            "payments",
            "2",
            "0",
            "1",
            "1",
            "0",
            "0",
            "0",
        ]
    finally:
        drop_store(taskonce.open_store(POSTGRES_URL, table=table))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stats", "--store", "sqlite:///x.db", "--prefix", "p"], "--prefix applies to a Redis"),
        (
            ["stats", "--store", "redis://127.0.0.1:1/0", "--table", "t"],
            "--table applies to an SQL",
        ),
        (["purge", "--store", "memory://", "--queue", "q"], "purge takes no --queue: it deletes"),
        (["init-db", "--store", "sqlite:///x.db", "--queue", "q"], "init-db takes no --queue"),
    ],
)
def test_options_that_do_not_apply_are_refused(
    argv: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(*argv)[0] == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


# -- exit statuses, missing extras, keys without a record, bench outside a checkout -------------


def test_a_missing_driver_is_one_line_naming_the_extra_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    for command in ("stats", "init-db"):
        code, text = run(command, "--store", "postgresql://postgres:hunter2@127.0.0.1:1/test")
        err = capsys.readouterr().err
        assert (code, text) == (2, "") and err.count("\n") == 1
        assert err.startswith("taskonce: error: store URL 'postgresql+psycopg://postgres:***@")
        assert "needs psycopg 3, which is not installed" in err and "hunter2" not in err
        assert "pip install 'taskonce[sql]' (postgresql:// means postgresql+psycopg://)" in err
    code, _ = run("stats", "--store", "postgresql+psycopg2://postgres@127.0.0.1:1/test")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "names the psycopg2 driver, which is not installed" in err
    assert "write the URL as postgresql+psycopg://user:password@host/db" in err


def test_a_missing_redis_extra_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delitem(sys.modules, "taskonce.stores.redis")
    monkeypatch.setitem(sys.modules, "redis", None)
    code, _ = run("stats", "--store", "redis://127.0.0.1:1/0")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("taskonce: error: store URL 'redis://127.0.0.1:1/0': the Redis store")
    assert err.rstrip().endswith("pip install 'taskonce[redis]'")


def test_inspect_and_release_of_a_key_without_a_record_say_the_form_and_suggest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/k.db"
    guard = taskonce.Guard(taskonce.open_store(url))
    for queue in ("celery", "mail:box"):
        guard.run("order-B1", queue, lambda: None)
    guard.run("order-B11", "celery", lambda: None)
    guard.close()
    form = (
        "keys are QUEUE:ID (e.g. celery:<task id>; --queue QUEUE ID builds one), or the message "
        "id alone with identity='id'"
    )
    both = "live keys ending in ':order-B1': celery:order-B1, mail%3Abox:order-B1"
    code, text = run("inspect", "order-B1", "--store", url)
    assert code == 1
    assert text.splitlines() == ["no live record for key 'order-B1'", form, both]
    # the same message id given on another queue: its queues are suggested
    code, text = run("inspect", "order-B1", "--queue", "payments", "--store", url)
    assert code == 1 and text.splitlines()[2].endswith(": celery:order-B1, mail%3Abox:order-B1")
    # --json keeps its answer (null) on stdout; the hint goes to stderr
    code, text = run("--json", "inspect", "order-B1", "--store", url)
    assert (code, text) == (1, "null\n")
    assert capsys.readouterr().err == f"taskonce: {form}\ntaskonce: {both}\n"
    # release: the same answer and the same exit status as inspect
    code, text = run("release", "order-B1", "--store", url)
    assert code == 1
    assert text.splitlines() == ["no live record for key 'order-B1': nothing released", form, both]
    code, text = run("--json", "release", "nothing-like-it", "--store", url)
    assert code == 1 and json.loads(text) == {"key": "nothing-like-it", "released": False}
    assert "no live key ends in ':nothing-like-it' either" in capsys.readouterr().err
    assert run("release", "celery:order-B1", "--store", url)[0] == 0
    assert taskonce.open_store(url).get("mail%3Abox:order-B1") is not None


def test_a_queue_key_of_an_id_only_record_is_suggested_the_id(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/k.db"
    guard = taskonce.Guard(taskonce.open_store(url), default=taskonce.Policy(identity="id"))
    guard.run("order-B1", "celery", lambda: None)
    guard.close()
    code, text = run("inspect", "celery:order-B1", "--store", url)
    assert code == 1 and text.splitlines()[2] == "live keys ending in ':order-B1': order-B1"


@pytest.mark.parametrize("kind", [*STORE_KINDS, "redis-cluster"])
def test_keys_ending_finds_a_message_id_on_every_queue(kind: str, tmp_path: Path) -> None:
    store = make_store(kind, tmp_path)
    try:
        for key in ("celery:order-B1", "mail%3Abox:order-B1", "celery:order-B11", "x:a_b%*"):
            assert store.mark(key, 60, None, None)
        store.claim("payments:order-B1", "worker-1", 60, 60, None)
        store.mark("old:order-B1", 0.01, None, None)
        wait_for(lambda: store.get("old:order-B1") is None, what="the mark to expire")
        found = store.keys_ending(":order-B1")
        assert sorted(found) == ["celery:order-B1", "mail%3Abox:order-B1", "payments:order-B1"]
        assert len(store.keys_ending(":order-B1", limit=2)) == 2
        # LIKE's and glob's special characters are the text itself
        assert store.keys_ending(":a_b%*") == ["x:a_b%*"]
        assert store.keys_ending(":aXbY*") == [] and store.keys_ending("b%") == []
    finally:
        drop_store(store)


def test_the_redis_store_suggests_keys_in_its_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    require_service("redis")
    prefix = f"cli{uuid.uuid4().hex[:8]}"
    _fill(REDIS_URL, prefix=prefix)
    try:
        code, text = run("inspect", "m4", "--store", REDIS_URL, "--prefix", prefix)
        assert code == 1 and text.splitlines()[2] == "live keys ending in ':m4': mail%3Abox:m4"
        code, text = run("release", "m1", "--store", REDIS_URL, "--prefix", prefix)
        assert code == 1 and text.splitlines()[2] == "live keys ending in ':m1': payments:m1"
    finally:
        drop_store(taskonce.open_store(REDIS_URL, prefix=prefix))


def test_exit_statuses_are_one_rule_in_help_and_docs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "exit status, the same for every command:\n  0    done" in help_text
    for line in (
        "  1    not there: inspect/release found no live record for KEY",
        "  2    could not run as asked, said in one line on stderr",
        "  70   an unexpected error (its traceback on stderr)",
        "  130  interrupted (Ctrl-C)",
    ):
        assert line in help_text
    operations = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    table = operations.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    assert re.findall(r"^\| `(\d+)` \|", table, re.M) == ["0", "1", "2", "70", "130"]
    # a usage error is argparse's 2
    with pytest.raises(SystemExit) as done:
        main(["inspect"])
    assert done.value.code == 2


def test_an_unexpected_error_exits_70_and_ctrl_c_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import taskonce.cli

    def broken(args: object, out: object) -> int:
        raise RuntimeError("a bug")

    def interrupted(args: object, out: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(taskonce.cli.stats, "run", broken)
    assert run("stats", "--store", "memory://")[0] == 70
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith("RuntimeError: a bug\n")
    monkeypatch.setattr(taskonce.cli.stats, "run", interrupted)
    assert run("stats", "--store", "memory://")[0] == 130
    assert capsys.readouterr().err == "taskonce: interrupted\n"


def test_bench_is_hidden_and_says_so_outside_a_source_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import taskonce.cli

    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"^    bench ", capsys.readouterr().out, re.M)  # in this checkout
    missing = tmp_path / "bench" / "store_ops.py"
    monkeypatch.setattr(taskonce.cli.bench, "script", lambda: missing)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "bench" not in capsys.readouterr().out
    for argv in (["bench"], ["bench", "--help"], ["bench", "--stores", "redis"]):
        code, text = run(*argv)
        err = capsys.readouterr().err
        assert (code, text) == (2, "")
        assert err == (
            "taskonce: error: taskonce bench needs a source checkout: it runs "
            "bench/store_ops.py of a clone installed with pip install -e . "
            f"({missing} is not there in this installation)\n"
        )


def test_a_missing_optional_module_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's last resort for an ImportError names the extra of the module it misses, not
    taskonce[all] (which pulls in PySpark)."""
    import taskonce.cli as cli_module

    def missing(*_: object) -> int:
        raise ModuleNotFoundError("No module named 'sqlalchemy'", name="sqlalchemy")

    monkeypatch.setattr(cli_module.stats, "run", missing)
    assert cli_module.main(["stats", "--store", "memory://"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "taskonce: error: No module named 'sqlalchemy' (it comes with the 'sql' extra: "
        "pip install 'taskonce[sql]')\n"
    )
