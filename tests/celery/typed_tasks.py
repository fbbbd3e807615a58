"""Tasks of the serializer tests (``tests/celery/test_serializers.py``), registered on the app
under test: each checks the types of the arguments it received and counts its run under its
label (``label:wrong-types`` and an error when they are not what was sent)."""

from __future__ import annotations

from typing import Any

from celery import chain, chord, group

from tests.celery.app_under_test import count_run, guarded_task
from tests.typed_values import PARCEL, VALUES, wrong_types


def _check(task: Any, table: str, label: str, values: tuple[Any, ...], expected: Any) -> str:
    wrong = wrong_types(values, expected)
    if wrong:
        count_run(table, task, f"{label}:wrong-types")
        raise TypeError(f"{label}: {wrong}")
    count_run(table, task, label)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed")
def typed(self: Any, table: str, label: str, *values: Any, **extra: Any) -> str:
    """Takes the four values of :data:`tests.typed_values.VALUES` (a datetime, a Decimal, a
    UUID, bytes) positionally, ``when=`` the datetime again as a keyword."""
    expected = (*VALUES, VALUES[0])
    return _check(self, table, label, (*values, extra.get("when")), expected)


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed_obj")
def typed_obj(self: Any, table: str, label: str, parcel: Any) -> str:
    """Takes :data:`tests.typed_values.PARCEL` (an object only pickle carries)."""
    return _check(self, table, label, (parcel,), (PARCEL,))


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed_fail")
def typed_fail(self: Any, table: str, label: str) -> str:
    """Counts its run and fails (a chord header or a task with ``link_error``)."""
    count_run(table, self, label)
    raise RuntimeError(f"{label} fails on purpose")


def typed_sig(app: Any, table: str, label: str) -> Any:
    """The immutable signature of ``t.typed`` with the four values."""
    return app.signature(
        "t.typed", args=(table, label, *VALUES), kwargs={"when": VALUES[0]}, immutable=True
    )


def _sig(app: Any, name: str, table: str, label: str) -> Any:
    return app.signature(name, args=(table, label), immutable=True)


#: what :func:`send_shape` sends for each shape: the labels that must each run once
SHAPES: dict[str, tuple[str, ...]] = {
    "delay": ("delay",),
    "chain": ("chain-1", "chain-2"),
    "group": ("group-0", "group-1"),
    "chord": ("chord-h0", "chord-h1", "chord-body"),
    "link": ("link-first", "link-callback"),
    "link_error": ("link_error-fails", "link_error-errback"),
    "group_link": ("group_link-0", "group_link-1", "group_link-callback"),
    "chord_errback": ("chord_errback-fails", "chord_errback-errback"),
}


def send_shape(app: Any, table: str, prefix: str, shape: str) -> None:
    """Send one canvas shape carrying the four values through ``app`` (by task name, so the
    test process's publisher app sends them too); labels ``{prefix}{label of SHAPES}``."""
    p = prefix
    if shape == "delay":
        typed_sig(app, table, f"{p}delay").apply_async()
    elif shape == "chain":
        chain(typed_sig(app, table, f"{p}chain-1"), typed_sig(app, table, f"{p}chain-2"))()
    elif shape == "group":
        group(typed_sig(app, table, f"{p}group-0"), typed_sig(app, table, f"{p}group-1"))()
    elif shape == "chord":
        chord(
            [typed_sig(app, table, f"{p}chord-h0"), typed_sig(app, table, f"{p}chord-h1")],
            typed_sig(app, table, f"{p}chord-body"),
        )()
    elif shape == "link":
        _sig(app, "t.record", table, f"{p}link-first").apply_async(
            link=typed_sig(app, table, f"{p}link-callback")
        )
    elif shape == "link_error":
        _sig(app, "t.typed_fail", table, f"{p}link_error-fails").apply_async(
            link_error=typed_sig(app, table, f"{p}link_error-errback")
        )
    elif shape == "group_link":
        members = group(
            _sig(app, "t.record", table, f"{p}group_link-0"),
            _sig(app, "t.record", table, f"{p}group_link-1"),
        )
        members.link(typed_sig(app, table, f"{p}group_link-callback"))
        members.apply_async()
    elif shape == "chord_errback":
        failing = chord(
            [_sig(app, "t.typed_fail", table, f"{p}chord_errback-fails")],
            typed_sig(app, table, f"{p}chord_errback-never"),
        )
        failing.link_error(typed_sig(app, table, f"{p}chord_errback-errback"))
        failing.apply_async()
    else:
        raise ValueError(f"unknown shape {shape!r}")


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed_sender")
def typed_sender(self: Any, table: str, label: str, shapes: list[str]) -> str:
    """Sends each shape of ``shapes`` from its body (the hand-off: captured, recorded with its
    outcome, published after it), labels prefixed ``{label}/``."""
    count_run(table, self, label)
    for shape in shapes:
        send_shape(self.app, table, f"{label}/", shape)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed_replacer")
def typed_replacer(self: Any, table: str, label: str) -> Any:
    """Replaces itself with ``t.typed`` carrying the four values (label ``{label}-replaced``)."""
    count_run(table, self, label)
    return self.replace(typed_sig(self.app, table, f"{label}-replaced"))


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.typed_obj_sender")
def typed_obj_sender(self: Any, table: str, label: str) -> str:
    """Sends ``t.typed_obj`` with the parcel from its body (label ``{label}-child``)."""
    count_run(table, self, label)
    typed_obj.delay(table, f"{label}-child", PARCEL)
    return label
