"""Every store refuses the same bad arguments with the same error and the same text, and writes
nothing: the checks are the base's (:mod:`taskonce.stores.arguments`), run before any store's
primitive. The memory store's answer is the reference; each case must be an ``InvalidInput``
there, and every other store must answer it word for word."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from taskonce.errors import InvalidInput
from taskonce.stores import Awaiting, MemoryStore, Store
from tests.helpers import DJANGO_KINDS, REDIS_DEPLOYMENTS, STORE_KINDS, opened_store

KEY = "q:bad-input"
LONG_KEY = "q:" + "k" * 298  # 300 characters: over every store's limit of 255
NAN, INF = float("nan"), float("inf")
DAY = 86400.0

Call = Callable[[Store], Any]


def _claim(**changed: Any) -> Call:
    args = {
        "key": KEY,
        "owner": "o1",
        "lease": 60.0,
        "keep_for": DAY,
        "fingerprint": "fp",
        "worker": "h/1/2/3",
    }
    args.update(changed)
    return lambda store: store.claim(**args)


def _mark(**changed: Any) -> Call:
    args: dict[str, Any] = {"key": KEY, "keep_for": DAY, "fingerprint": None, "result": None}
    args.update(changed)
    return lambda store: store.mark(**args)


#: (case, call): every one must be refused before it reaches the store
CASES: list[tuple[str, Call]] = [
    ("claim: a key of 300 characters", _claim(key=LONG_KEY)),
    ("claim: an empty key", _claim(key="")),
    ("claim: a key that is not a str", _claim(key=42)),
    ("claim: key None", _claim(key=None)),
    ("claim: a negative lease", _claim(lease=-1)),
    ("claim: a lease of 0", _claim(lease=0)),
    ("claim: a NaN lease", _claim(lease=NAN)),
    ("claim: an infinite lease", _claim(lease=INF)),
    ("claim: a bool lease", _claim(lease=True)),
    ("claim: a lease as text", _claim(lease="60")),
    ("claim: a negative keep_for", _claim(keep_for=-1.0)),
    ("claim: a NaN keep_for", _claim(keep_for=NAN)),
    ("claim: a bool keep_for", _claim(keep_for=True)),
    ("claim: an empty owner", _claim(owner="")),
    ("claim: owner None", _claim(owner=None)),
    ("claim: an owner of 65 characters", _claim(owner="o" * 65)),
    ("claim: an owner that is not a str", _claim(owner=7)),
    ("claim: a fingerprint of 65 characters", _claim(fingerprint="f" * 65)),
    ("claim: a fingerprint that is not a str", _claim(fingerprint=5)),
    ("claim: a worker of 256 characters", _claim(worker="w" * 256)),
    ("claim: an empty worker", _claim(worker="")),
    ("take_over: worker None", lambda s: s.take_over(KEY, "o1", "o2", 60, DAY, None)),  # type: ignore[arg-type]
    ("take_over: an empty old owner", lambda s: s.take_over(KEY, "", "o2", 60, DAY, "w")),
    ("quarantine: a keep_for of 0", lambda s: s.quarantine(KEY, "o1", 0)),
    ("complete: a key of 300 characters", lambda s: s.complete(LONG_KEY, "o1", DAY, None)),
    ("complete: an empty owner", lambda s: s.complete(KEY, "", DAY, None)),
    ("complete: a negative dispatch lease", lambda s: s.complete(KEY, "o1", DAY, None, ["{}"], -1)),
    ("complete: a result that is not text", lambda s: s.complete(KEY, "o1", DAY, 5)),  # type: ignore[arg-type]
    ("release: an empty key", lambda s: s.release("", "o1")),
    ("release: an empty owner", lambda s: s.release(KEY, "")),
    ("release (an operator's): a key of 300 characters", lambda s: s.release(LONG_KEY, None)),
    ("renew: a NaN lease", lambda s: s.renew(KEY, "o1", NAN)),
    ("mark: a key of 300 characters", _mark(key=LONG_KEY)),
    ("mark: a bool keep_for", _mark(keep_for=False)),
    ("mark: sends with an empty token", _mark(sends=["{}"], token="")),
    ("mark: sends as one str", _mark(sends="{}", token="t")),
    ("mark: a send that is not text", _mark(sends=[1], token="t")),
    ("mark: a result that is not text", _mark(result=b"1")),
    ("get: a key of 300 characters", lambda s: s.get(LONG_KEY)),
    ("get: a key that is not a str", lambda s: s.get(b"q:1")),  # type: ignore[arg-type]
    ("beat: an empty worker", lambda s: s.beat("", 10)),
    ("beat: a ttl of 0", lambda s: s.beat("h/1/2/3", 0)),
    ("seen: a worker of 256 characters", lambda s: s.seen("w" * 256)),
    ("take_sends: an empty token", lambda s: s.take_sends(KEY, "", 10)),
    ("take_sends: a negative lease", lambda s: s.take_sends(KEY, "t", -1)),
    ("take_sends: a NaN older_than", lambda s: s.take_sends(KEY, "t", 10, NAN)),
    ("dispatched: awaiting that is not an Awaiting", lambda s: s.dispatched(KEY, "t", "x")),  # type: ignore[arg-type]
    ("take_receipts: a negative lease", lambda s: s.take_receipts(KEY, "t", -1)),
    (
        "settle_receipts: an empty token",
        lambda s: s.settle_receipts(KEY, "", Awaiting("[]", 0.0, 60.0)),
    ),
    ("have_records: one key as a str", lambda s: s.have_records(KEY)),
    ("have_records: an empty key among them", lambda s: s.have_records([KEY, ""])),
    ("due_for_relay: a limit of 0", lambda s: s.due_for_relay(0.0, 0)),
    ("due_for_relay: a bool limit", lambda s: s.due_for_relay(0.0, True)),
    ("due_for_relay: a negative older_than", lambda s: s.due_for_relay(-1.0, 10)),
    ("purge: a batch of 0", lambda s: s.purge(0)),
    ("purge: a negative batch", lambda s: s.purge(-5)),
    ("purge: a bool batch", lambda s: s.purge(True)),
    ("purge: a float batch", lambda s: s.purge(1.5)),  # type: ignore[arg-type]
    ("purge: a batch as text", lambda s: s.purge("10")),  # type: ignore[arg-type]
    ("keys_ending: a negative limit", lambda s: s.keys_ending(":m1", -1)),
    ("keys_ending: a suffix that is not a str", lambda s: s.keys_ending(None)),  # type: ignore[arg-type]
    ("records: a key prefix that is not a str", lambda s: list(s.records(5))),  # type: ignore[arg-type]
]


def refusal(store: Store, call: Call) -> tuple[type[BaseException], str] | None:
    """The error ``call`` raised on ``store`` (its type and text), or None when it passed."""
    try:
        call(store)
    except Exception as exc:  # the point is to compare whatever is raised
        return type(exc), str(exc)
    return None


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[type[BaseException], str] | None]:
    """Every case's answer on the memory store."""
    memory = MemoryStore()
    return {case: refusal(memory, call) for case, call in CASES}


@pytest.fixture(params=[*STORE_KINDS, *REDIS_DEPLOYMENTS, *DJANGO_KINDS])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    yield from opened_store(request.param, tmp_path)


def test_the_reference_refuses_every_case_as_invalid_input(
    reference: dict[str, tuple[type[BaseException], str] | None],
) -> None:
    passed = [case for case, answer in reference.items() if answer is None]
    assert not passed, f"the memory store accepted: {passed}"
    wrong = {case: answer for case, answer in reference.items() if answer[0] is not InvalidInput}  # type: ignore[index]
    assert not wrong, f"not InvalidInput: {wrong}"


def test_every_store_refuses_the_same_bad_input_the_same_way_and_writes_nothing(
    store: Store, reference: dict[str, tuple[type[BaseException], str] | None]
) -> None:
    differing = {}
    for case, call in CASES:
        answer = refusal(store, call)
        if answer != reference[case]:
            differing[case] = (answer, reference[case])
    assert not differing, "answers differing from the memory store's:\n" + "\n".join(
        f"  {case}: {got!r}, memory: {want!r}" for case, (got, want) in differing.items()
    )
    assert store.get(KEY) is None
    assert list(store.records()) == []
    assert store.seen("h/1/2/3") is None
    due = store.due_for_relay(0.0, 10)
    assert (due.sends, due.receipts) == ([], [])
    assert store.stats()["keys"] == 0
