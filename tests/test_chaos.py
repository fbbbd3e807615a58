"""The chaos soak, short: both frameworks at once, transactional PostgreSQL store, eager mode.

Two soaks (``tools/soak/soak.py``) run side by side, each with its own broker redis-server, two
real workers of two processes, 120 messages over 20 s and a fault every 1–3 s (every kind that
applies to a PostgreSQL store: pool processes SIGKILLed and SIGSTOPped past the lease, whole
workers SIGKILLed, messages published again, this run's PostgreSQL backends terminated, the
broker restarted). Each must end with exactly one ledger row per key. The long runs are
``make chaos``. The seeds are fixed so that every run injects the same sequence of faults.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import IN_CI, require_service
from tools.soak.children import account, grace
from tools.soak.verdict import judge, lost_by_broker

ROOT = Path(__file__).resolve().parents[1]
SEEDS = {"celery": 1101, "dramatiq": 2202}


@pytest.mark.timeout(600)  # the soaks' own deadlines (start, drain) come first
def test_celery_and_dramatiq_keep_exactly_one_ledger_row_per_key_under_faults(
    tmp_path: Path,
) -> None:
    require_service("postgresql")
    require_service("redis")
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    soaks = {
        framework: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tools.soak.soak",
                "--framework",
                framework,
                "--store",
                "postgresql",
                "--messages",
                "120",
                "--seconds",
                "20",
                "--drain-timeout",
                "240",
                "--seed",
                str(seed),
                "--out",
                str(tmp_path),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for framework, seed in SEEDS.items()
    }
    try:
        outputs = {name: soak.communicate(timeout=480)[0].decode() for name, soak in soaks.items()}
    finally:
        for soak in soaks.values():  # a soak stopped early stops its own servers and workers
            if soak.poll() is None:
                soak.terminate()
                soak.wait(timeout=120)
    for framework, soak in soaks.items():
        reports = list(tmp_path.glob(f"*-{framework}-pg-tx-eager-*/report.json"))
        assert len(reports) == 1, outputs[framework]
        report = json.loads(reports[0].read_text())
        assert soak.returncode == 0, (outputs[framework], report)
        assert report["held"] and report["drained"], report
        assert report["messages"] == 120
        assert report["lost"] == 0 and report["doubled"] == 0, report
        assert report["faults_total"] >= 3, report  # ~10 are tried; a kill finding no body skips
        assert report["runs"] >= 120, report
        folder = reports[0].parent
        assert (folder / "faults.jsonl").stat().st_size > 0
        assert list(folder.glob("worker-*.log"))


def _events(**counts: int) -> collections.Counter[str]:
    return collections.Counter(counts)


def test_the_ledger_check_finds_lost_and_doubled_keys() -> None:
    expected = [("k1", "parent"), ("k2", "parent"), ("k3", "parent")]
    counts = {("k1", "parent"): 1, ("k3", "parent"): 2}
    events = {("k3", "parent"): _events(claimed=2, lease_taken_over=1, completed=1)}
    strict = judge(expected, counts, events, {}, {}, transactional=True)
    assert strict.lost == ["k2/parent"]
    assert list(strict.doubled) == ["k3/parent"]
    assert not strict.held

    counts[("k2", "parent")] = 1
    assert not judge(expected, counts, events, {}, {}, transactional=True).held
    relaxed = judge(expected, counts, events, {}, {}, transactional=False)
    assert relaxed.held
    assert relaxed.doubled["k3/parent"]["explained_by"] == ["lease_taken_over"]


def test_a_second_row_without_a_fault_is_unexplained() -> None:
    expected = [("k1", "parent")]
    counts = {("k1", "parent"): 2}
    quiet = {("k1", "parent"): _events(claimed=1, completed=1, duplicate_skipped=1)}
    verdict = judge(expected, counts, quiet, {("k1", "parent"): {41}}, {}, transactional=False)
    assert verdict.unexplained == ["k1/parent"] and not verdict.held
    hit = judge(
        expected, counts, quiet, {("k1", "parent"): {41}}, {41: "kill_child"}, transactional=False
    )
    assert hit.held and hit.doubled["k1/parent"]["explained_by"] == ["kill_child:41"]


def test_the_drain_publishes_lost_parents_again_and_leaves_children_to_taskonce() -> None:
    missing = [("k1", "parent"), ("k2", "child"), ("k3", "child"), ("k1", "child")]
    ids = {item: f"{item[0]}-{item[1]}" for item in missing}
    last = {"k1-parent": "claimed", "k2-child": "released"}  # k3's child was never received
    split = lost_by_broker(missing, ids, last, dispatched={"k2"})
    assert split.failure is None
    # k1's child waits for k1, which runs again and sends it; the soak publishes no child
    assert split.republish == [("k1", "parent")]
    assert split.waiting == ["k2", "k3"]
    assert split.undispatched == ["k3"]  # its parent's sends are still the relay's to publish


def test_a_child_its_guard_claimed_is_published_again_when_its_retry_is_lost() -> None:
    # k1's child arrived and failed (its guard noted it: the receipt) and the framework lost
    # its retry: published again like a parent; k2's child never arrived: taskonce's
    missing = [("k1", "child"), ("k2", "child")]
    ids = {("k1", "child"): "c1", ("k2", "child"): "c2"}
    split = lost_by_broker(missing, ids, {"c1": "released"}, {"k1", "k2"}, frozenset({"c1"}))
    assert split.republish == [("k1", "child")]
    assert split.waiting == ["k2"] and split.undispatched == []


def test_a_handled_item_without_its_row_fails() -> None:
    missing = [("k1", "child")]
    ids = {("k1", "child"): "c1"}
    waiting = lost_by_broker(missing, ids, {}, dispatched=set())
    assert waiting.republish == [] and waiting.waiting == ["k1"]
    assert waiting.failure is None
    handled = lost_by_broker(missing, ids, {"c1": "completed"}, dispatched={"k1"})
    assert handled.failure == "k1/child was recorded as handled but has no ledger row"
    assert handled.republish == []
    parent = lost_by_broker([("k2", "parent")], {("k2", "parent"): "p2"}, {"p2": "marked"}, set())
    assert parent.failure is not None and "k2/parent" in parent.failure


def _resent(parent: str) -> dict[str, object]:
    return {"event": "sends_redispatched", "reason": "unconfirmed", "key": parent, "count": 1}


def test_children_repaired_by_taskonce_are_told_from_slow_ones() -> None:
    parents = {f"q:p{i}": f"k{i}" for i in range(1, 6)}
    children = {f"c{i}": f"k{i}" for i in range(1, 6)}
    events = [
        _resent("q:p1"),  # k1: lost, re-sent once, the copy ran
        {"event": "sends_redispatched", "reason": None, "key": "q:p2", "count": 1},  # redelivery
        _resent("q:p3"),  # k3: slow: the first copy ran, the re-sent one was skipped
        {"event": "duplicate_skipped", "message_id": "c3"},
        _resent("q:p4"),  # k4: re-sent twice, the first re-send lost too, the second ran
        _resent("q:p4"),
        _resent("q:p5"),  # k5: re-sent three times, given up on, never ran
        _resent("q:p5"),
        _resent("q:p5"),
        {"event": "send_unconfirmed", "message_id": "c5"},
    ]
    counts = {(f"k{i}", "child"): 1 for i in range(1, 5)}
    found = account(events, parents, children, counts)
    assert found.resent == {"k1": 1, "k3": 1, "k4": 2, "k5": 3}
    assert found.repaired == ["k1", "k4"]
    assert found.found_run == 1
    assert found.unconfirmed == ["k5"] and found.unconfirmed_never_ran == ["k5"]
    assert found.failure is not None and "k5/child" in found.failure
    report = found.as_report()
    assert report["children_repaired"] == 2 and report["child_resends"] == 7
    assert report["send_unconfirmed"] == 1 and report["resends_found_run"] == 1

    counts[("k5", "child")] = 1  # it ran after all, late: reported, not a failure
    assert account(events, parents, children, counts).failure is None
    counts[("k1", "child")] = 2  # re-sent and ran twice: a failure
    doubled = account(events, parents, children, counts)
    assert doubled.resent_doubled == ["k1"]
    assert doubled.failure is not None and "more than once" in doubled.failure


def test_a_missing_child_waits_the_receipts_whole_window() -> None:
    # looks after 10, then 20, 40 and 80 s more (150 s), each late by up to a relay period
    assert grace(10.0, 5.0) == 150.0 + 4 * 5.0 + 15.0
