"""The guard's decision table on the in-process store, with a fake clock where time matters."""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import pytest

import taskonce
from taskonce import Decision, Delivery, Guard, Policy
from taskonce.errors import (
    ConfigError,
    InProgressElsewhere,
    InvalidInput,
    LeaseLost,
    PayloadMismatch,
)
from taskonce.events import FIELDS, read_jsonl
from taskonce.guard import FIRST_RECHECK
from taskonce.keys import fingerprint, make_key
from taskonce.stores import MemoryStore
from taskonce.worker import LIVENESS_WINDOW


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


class Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def emit(self, event: Any) -> None:
        with self.lock:
            self.events.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]


class Counter:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> Any:
        self.calls.append(args)
        return {"charged": list(args)}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sink() -> Sink:
    return Sink()


def make_guard(clock: Clock, sink: Sink, **policy: Any) -> Guard:
    return Guard(MemoryStore(clock=clock), default=Policy(**policy), events=[sink])


# -- eager ---------------------------------------------------------------------------------


def test_eager_runs_once_and_skips_the_duplicate(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, store_result=True)
    handler = Counter()
    first = guard.run("m1", "payments", handler, 7)
    second = guard.run("m1", "payments", handler, 7)
    assert first.status == "ran" and second.status == "skipped"
    assert handler.calls == [(7,)]
    assert second.value == {"charged": [7]}  # the first run's stored result, not overwritten
    assert sink.names() == ["claimed", "completed", "duplicate_skipped"]
    assert guard.store.get("payments:m1").result == json.dumps(
        {"charged": [7]}, separators=(",", ":")
    )  # type: ignore[union-attr]


def test_eager_failure_releases_so_the_retry_runs(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink)
    attempts: list[int] = []

    def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("card declined")
        return "ok"

    for _ in range(2):
        with pytest.raises(RuntimeError, match="card declined"):
            guard.run("m1", "q", flaky)
    assert guard.run("m1", "q", flaky).value == "ok"
    assert len(attempts) == 3
    assert sink.names() == ["claimed", "released"] * 2 + ["claimed", "completed"]
    assert guard.run("m1", "q", flaky).status == "skipped"


def test_in_progress_duplicate_is_deferred_by_the_remaining_lease(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, lease=10)
    running = guard.begin(Delivery("m1", "q"))
    assert running.decision is Decision.RUN
    clock.now += 7
    with pytest.raises(InProgressElsewhere) as info:
        guard.execute(Delivery("m1", "q"), Counter())
    # the lease ends before the liveness check and before another 7 s of running
    assert info.value.retry_after == pytest.approx(3)
    assert "in_progress_deferred" in sink.names()
    guard.finish(running)
    assert guard.execute(Delivery("m1", "q"), Counter()).status == "skipped"


def test_in_progress_duplicate_comes_back_when_the_owners_liveness_would_lapse(
    clock: Clock, sink: Sink
) -> None:
    """A long lease does not make a duplicate wait for it: it is delivered again just after
    the owner's liveness record would lapse, to find out whether the owner died meanwhile."""
    guard = make_guard(clock, sink, lease=300)
    running = guard.begin(Delivery("m1", "q"))
    assert running.decision is Decision.RUN
    clock.now += 9
    with pytest.raises(InProgressElsewhere) as info:
        guard.execute(Delivery("m1", "q"), Counter())
    assert info.value.retry_after == pytest.approx(LIVENESS_WINDOW - 9 + 0.5)
    assert "in_progress_deferred" in sink.names()
    guard.finish(running)
    assert guard.execute(Delivery("m1", "q"), Counter()).status == "skipped"


def test_in_progress_duplicate_with_skip_policy_is_skipped(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, on_in_progress="skip")
    guard.begin(Delivery("m1", "q"))
    handler = Counter()
    assert guard.execute(Delivery("m1", "q"), handler).status == "skipped"
    assert handler.calls == []
    assert sink.names()[-1] == "duplicate_skipped"


def test_expired_lease_is_taken_over_and_the_stale_owner_is_fenced(
    clock: Clock, sink: Sink
) -> None:
    guard = make_guard(clock, sink, lease=30)
    stale = guard.begin(Delivery("m1", "q"))
    guard._stop_heartbeat(stale)  # the worker died: nothing renews its lease
    clock.now += 31
    fresh = guard.begin(Delivery("m1", "q"))
    assert fresh.decision is Decision.RUN
    assert sink.names() == ["claimed", "lease_taken_over"]
    with pytest.raises(LeaseLost):
        guard.finish(stale)
    assert sink.names()[-1] == "lease_lost"
    guard.fail(stale)  # a zombie's rollback is refused too, and does not raise
    guard.finish(fresh)
    assert sink.names()[-1] == "completed"


def test_long_handler_keeps_its_claim_by_heartbeat(sink: Sink) -> None:
    guard = Guard(MemoryStore(), default=Policy(lease=0.3), events=[sink])
    renewed_twice = threading.Event()
    deferred: list[float] = []

    class Watch(Sink):
        def emit(self, event: Any) -> None:
            if sink.names().count("lease_renewed") >= 2:
                renewed_twice.set()

    guard.sinks.append(Watch())

    def long_handler() -> str:
        assert renewed_twice.wait(5), "the heartbeat did not renew the lease"
        # well past the 0.3 s lease: a duplicate must still see the claim as live
        with pytest.raises(InProgressElsewhere) as info:
            guard.execute(Delivery("m1", "q"), Counter())
        deferred.append(info.value.retry_after)
        return "done"

    assert guard.execute(Delivery("m1", "q"), long_handler).value == "done"
    assert deferred and 0 < deferred[0] <= 0.3
    assert "lease_lost" not in sink.names()
    assert sink.names()[-1] == "completed"


def test_a_duplicate_comes_back_about_as_long_after_as_the_owner_has_run(
    clock: Clock, sink: Sink
) -> None:
    """A claim that has just begun most likely ends soon: its duplicate is looked at again
    after FIRST_RECHECK, then after about as long as the owner has run so far (a doubling
    interval), up to the owner's liveness check; once the claim is completed it is skipped."""
    guard = make_guard(clock, sink, lease=300)
    start = clock.now
    running = guard.begin(Delivery("m1", "q"))
    waits = []
    for ran in (0.0, 0.01, 1.0, 3.0, 9.0):
        clock.now = start + ran
        with pytest.raises(InProgressElsewhere) as info:
            guard.execute(Delivery("m1", "q"), Counter())
        waits.append(info.value.retry_after)
    assert waits == pytest.approx(
        [FIRST_RECHECK, FIRST_RECHECK, 1.0, 3.0, LIVENESS_WINDOW - 9 + 0.5]
    )
    guard.finish(running)
    assert guard.execute(Delivery("m1", "q"), Counter()).status == "skipped"


def test_a_copy_deferred_before_is_deferred_again_as_a_recheck(clock: Clock, sink: Sink) -> None:
    """The adapters count the guard's deferrals on the copy they publish again; deferring such
    a copy again says ``reason: "recheck"``, so the audit counts one duplicate, not one per
    deferral."""
    guard = make_guard(clock, sink, lease=300)
    running = guard.begin(Delivery("m1", "q"))
    for deferred in (0, 1, 2):
        with pytest.raises(InProgressElsewhere):
            guard.execute(Delivery("m1", "q", deferred=deferred), Counter())
    reasons = [e["reason"] for e in sink.events if e["event"] == "in_progress_deferred"]
    assert reasons == [None, "recheck", "recheck"]
    guard.finish(running)


# -- lazy ----------------------------------------------------------------------------------


def test_lazy_marks_after_success_and_skips_later(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, mode="lazy")
    handler = Counter()
    guard.run("m1", "q", handler, 1)
    guard.run("m1", "q", handler, 1)
    assert handler.calls == [(1,)]
    assert sink.names() == ["marked", "duplicate_skipped"]


def test_lazy_failure_stores_nothing(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, mode="lazy")

    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        guard.run("m1", "q", boom)
    assert guard.store.get("q:m1") is None
    assert sink.names() == []


def test_lazy_concurrent_duplicate_is_detected_at_mark(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, mode="lazy")
    first = guard.begin(Delivery("m1", "q"))
    second = guard.begin(Delivery("m1", "q"))
    assert first.decision is second.decision is Decision.RUN  # both run: that is lazy mode
    guard.finish(first)
    guard.finish(second)
    assert sink.names() == ["marked", "concurrent_duplicate"]


# -- keys, identity, policies --------------------------------------------------------------


def test_identity_id_ignores_the_queue(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, identity="id")
    handler = Counter()
    guard.run("m1", "a", handler)
    assert guard.run("m1", "b", handler).status == "skipped"
    assert len(handler.calls) == 1


def test_queue_is_part_of_the_default_key(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink)
    handler = Counter()
    guard.run("m1", "a", handler)
    guard.run("m1", "b", handler)
    assert len(handler.calls) == 2
    assert make_key("c", "a:b", "id+queue") != make_key("b:c", "a", "id+queue")


def test_per_queue_policies_and_per_task_override(clock: Clock) -> None:
    guard = Guard(
        MemoryStore(clock=clock),
        default=Policy(lease=100),
        queues={"payments": {"mode": "lazy"}, "mail": Policy(enabled=False)},
    )
    assert guard.policy_for("other") == Policy(lease=100)
    assert guard.policy_for("payments") == Policy(lease=100, mode="lazy")
    assert guard.policy_for("payments", {"mode": "eager"}).mode == "eager"
    assert guard.policy_for("payments", {"keep_for": 5}).mode == "lazy"
    handler = Counter()
    guard.run("m1", "mail", handler)
    guard.run("m1", "mail", handler)
    assert len(handler.calls) == 2  # disabled: unguarded
    assert guard.store.get("mail:m1") is None


def test_fingerprint_is_canonical() -> None:
    assert fingerprint("t", (1, [2]), {"a": 1, "b": 2}) == fingerprint(
        "t", [1, (2,)], {"b": 2, "a": 1}
    )
    assert fingerprint("t", (1,), {}) != fingerprint("u", (1,), {})
    assert fingerprint("t", (1,), {}) != fingerprint("t", (2,), {})


# -- bad input: clear errors, nothing lost -------------------------------------------------


@pytest.mark.parametrize("message_id", [None, "", "   "])
def test_missing_or_empty_message_id_is_refused(clock: Clock, sink: Sink, message_id: Any) -> None:
    guard = make_guard(clock, sink)
    handler = Counter()
    with pytest.raises(InvalidInput, match="message id .* missing or empty"):
        guard.run(message_id, "q", handler)
    assert handler.calls == [] and guard.store.stats()["keys"] == 0


@pytest.mark.parametrize(
    ("message_id", "got"), [(123, "got int 123"), (b"m1", "got bytes b'm1'"), (1.5, "float 1.5")]
)
def test_non_string_message_id_says_it_must_be_a_string_and_what_it_got(
    clock: Clock, sink: Sink, message_id: Any, got: str
) -> None:
    guard = make_guard(clock, sink)
    handler = Counter()
    with pytest.raises(InvalidInput) as info:
        guard.run(message_id, "q", handler)
    assert "message id must be a string" in str(info.value)
    assert got in str(info.value)
    assert "missing or empty" not in str(info.value)
    assert handler.calls == [] and guard.store.stats()["keys"] == 0


def test_guard_given_a_url_suggests_open_store() -> None:
    with pytest.raises(ConfigError) as info:
        Guard("redis://:secret@localhost:6379/0")  # type: ignore[arg-type]
    text = str(info.value)
    assert "needs a taskonce Store, not str" in text
    assert "taskonce.open_store(url)" in text
    assert "secret" not in text  # a URL's password is never echoed


@pytest.mark.parametrize("queue", [None, 3, b"q", ""])
def test_non_string_queue_is_refused(clock: Clock, sink: Sink, queue: Any) -> None:
    guard = make_guard(clock, sink)
    with pytest.raises(InvalidInput, match="queue .* must be a non-empty string"):
        guard.run("m1", queue, Counter())
    assert guard.store.stats()["keys"] == 0


@pytest.mark.parametrize(("message_id", "queue"), [("m-\ud800", "q"), ("m1", "q\udfff")])
def test_id_or_queue_that_is_not_unicode_text_is_refused(
    clock: Clock, sink: Sink, message_id: str, queue: str
) -> None:
    guard = make_guard(clock, sink)
    handler = Counter()
    with pytest.raises(InvalidInput, match="not valid Unicode text .* encode as UTF-8"):
        guard.run(message_id, queue, handler)
    assert handler.calls == [] and guard.store.stats()["keys"] == 0


def test_over_long_key_is_refused(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink)
    with pytest.raises(InvalidInput, match="characters; the limit is 255"):
        guard.run("x" * 300, "q", Counter())
    assert guard.store.stats()["keys"] == 0


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("mode", "eventually", "Policy.mode='eventually' is not valid; choose one of eager, lazy"),
        ("lease", 0, "Policy.lease=0 must be a positive number of seconds"),
        ("lease", -5, "Policy.lease=-5 must be a positive number of seconds"),
        ("keep_for", "7d", "Policy.keep_for='7d' must be a positive number of seconds"),
        ("keep_for", float("inf"), "Policy.keep_for=inf must be a positive number of seconds"),
        ("crash_limit", -1, "Policy.crash_limit=-1 must be a whole number, 0 or more (0"),
        ("identity", "queue", "Policy.identity='queue' is not valid"),
        ("on_in_progress", "drop", "Policy.on_in_progress='drop' is not valid"),
        ("on_store_error", "ignore", "Policy.on_store_error='ignore' is not valid"),
        ("store_result", "yes", "Policy.store_result='yes' is not valid; it must be True or False"),
        ("transactional", 1, "Policy.transactional=1 is not valid"),
    ],
)
def test_bad_policy_values_name_the_field(field: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        Policy(**{field: value})
    assert str(info.value).startswith(expected)


def test_unknown_policy_field_and_bad_queue_policy() -> None:
    with pytest.raises(ConfigError, match="unknown Policy field.*leese"):
        Policy().replace(leese=3)
    with pytest.raises(ConfigError) as info:
        Policy().overridden_by({"mdoe": "lazy"})
    assert str(info.value).startswith("unknown Policy field(s) mdoe (did you mean 'mode'?); known:")
    with pytest.raises(ConfigError) as info:
        Policy().overridden_by({"mdoe": "lazy", "lesae": 3, "zzz": 1})
    assert "(did you mean 'lease' for 'lesae', 'mode' for 'mdoe'?)" in str(info.value)
    with pytest.raises(ConfigError, match="policy of queue 'payments': Policy.mode='x'"):
        Guard(MemoryStore(), queues={"payments": {"mode": "x"}})
    with pytest.raises(ConfigError, match="must be a Policy or a dict"):
        Guard(MemoryStore(), queues={"payments": "lazy"})  # type: ignore[dict-item]


def test_transactional_needs_an_sql_store() -> None:
    with pytest.raises(ConfigError, match="transactional=True needs an SQL store"):
        Guard(MemoryStore(), default=Policy(transactional=True))


def test_unknown_store_scheme_lists_the_supported_ones() -> None:
    with pytest.raises(
        ConfigError, match="unknown store URL scheme 'mongodb'.*supported: memory://"
    ):
        taskonce.open_store("mongodb://user:secret@host/db")
    with pytest.raises(ConfigError) as info:
        taskonce.open_store("mongodb://user:secret@host/db")
    assert "secret" not in str(info.value)


def test_payload_mismatch_refuses_and_keeps_the_first_record(clock: Clock, sink: Sink) -> None:
    guard = make_guard(clock, sink, store_result=True)
    handler = Counter()
    guard.run("m1", "q", handler, 10)
    before = guard.store.get("q:m1")
    with pytest.raises(PayloadMismatch, match="payload mismatch for key 'q:m1'.*not run"):
        guard.run("m1", "q", handler, 99)
    assert handler.calls == [(10,)]
    assert guard.store.get("q:m1") == before
    assert sink.names()[-1] == "payload_mismatch"


def test_unfingerprintable_arguments_run_without_the_check_and_one_warning(
    clock: Clock, sink: Sink, caplog: pytest.LogCaptureFixture
) -> None:
    """Arguments the payload encoding cannot encode never refuse a message: it runs once,
    unchecked, and the task gets one warning naming why (not one per delivery)."""
    guard = make_guard(clock, sink)
    handler = Counter()
    with caplog.at_level(logging.WARNING, logger="taskonce"):
        assert guard.run("m1", "q", handler, object()).status == "ran"
        assert guard.run("m1", "q", handler, object()).status == "skipped"
        assert guard.run("m2", "q", handler, object()).status == "ran"
    assert len(handler.calls) == 2
    warned = [r.getMessage() for r in caplog.records if "cannot be fingerprinted" in r.getMessage()]
    assert len(warned) == 1 and "object is not JSON serializable" in warned[0]
    assert guard.store.get("q:m1").fingerprint is None  # type: ignore[union-attr]


def test_unserialisable_result_is_an_error_but_the_key_stays_handled(
    clock: Clock, sink: Sink
) -> None:
    guard = make_guard(clock, sink, store_result=True)
    handler = Counter()

    def returns_a_set() -> set[int]:
        handler()
        return {1, 2}

    with pytest.raises(InvalidInput, match="result of task .* is not JSON-serialisable"):
        guard.run("m1", "q", returns_a_set)
    assert guard.run("m1", "q", returns_a_set).status == "skipped"
    assert len(handler.calls) == 1
    assert guard.store.get("q:m1").result is None  # type: ignore[union-attr]


# -- events --------------------------------------------------------------------------------


def test_events_have_exactly_the_public_fields(clock: Clock, tmp_path: Any) -> None:
    path = tmp_path / "events.jsonl"
    guard = Guard(
        MemoryStore(clock=clock), default=Policy(lease=10), events=[taskonce.JsonlEvents(path)]
    )
    guard.execute(
        Delivery("m1", "q", task="charge", framework="celery", attempt=2, redelivered=True),
        Counter(),
    )
    guard.execute(Delivery("m1", "q", task="charge"), Counter())
    events = read_jsonl(path)
    assert [e["event"] for e in events] == ["claimed", "completed", "duplicate_skipped"]
    for event in events:
        assert tuple(event) == FIELDS
        assert event["ts"].endswith("Z") and len(event["ts"]) == len("2026-11-22T03:10:36.123Z")
        assert event["worker"].endswith(f":{os.getpid()}")
        assert event["key"] == "q:m1" and event["lease_s"] == 10.0
    assert events[1]["framework"] == "celery" and events[1]["attempt"] == 2
    assert events[1]["redelivered"] is True and events[1]["duration_ms"] >= 0
    assert events[0]["duration_ms"] is None


def test_jsonl_lines_never_interleave_across_processes(tmp_path: Any) -> None:
    path = tmp_path / "events.jsonl"
    sink = taskonce.JsonlEvents(path)
    sink.emit({"event": "parent", "pad": "x" * 100})
    pids = []
    for child in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                threads = [
                    threading.Thread(
                        target=lambda t=t, child=child: [
                            sink.emit(
                                {"event": "e", "child": child, "t": t, "i": i, "pad": "y" * 300}
                            )
                            for i in range(250)
                        ]
                    )
                    for t in range(2)
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    lines = read_jsonl(path)  # json.loads fails on any torn line
    assert len(lines) == 1 + 4 * 2 * 250
    assert len({(e["child"], e["t"], e["i"]) for e in lines[1:]}) == 2000


def test_errors_survive_pickling_between_processes() -> None:
    import pickle

    for error in (
        LeaseLost("q:m1", "complete"),
        PayloadMismatch("q:m1", "a" * 64, "b" * 64),
        InProgressElsewhere("q:m1", 12.5),
        ConfigError("Policy.mode='x' is not valid"),
    ):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(InProgressElsewhere("k", 3.0))).retry_after == 3.0
