"""Policies: how one queue (or one task/actor) is guarded."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, Literal

from taskonce.checks import check_count, check_seconds
from taskonce.errors import ConfigError

Mode = Literal["eager", "lazy"]
Identity = Literal["id+queue", "id"]
OnInProgress = Literal["retry", "skip"]
OnStoreError = Literal["fail_closed", "fail_open"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "mode": ("eager", "lazy"),
    "identity": ("id+queue", "id"),
    "on_in_progress": ("retry", "skip"),
    "on_store_error": ("fail_closed", "fail_open"),
}
_FLAGS = (
    "store_result",
    "check_payload",
    "transactional",
    "enabled",
    "defer_sends",
    "check_first",
)
_SECONDS = ("lease", "keep_for")

#: A receipt is looked for until this many ``confirm_within`` after the publish: the first look
#: after 1, then (each time the send is published again) 2, 4 and 8 more (:mod:`taskonce.receipts`).
RECEIPT_WINDOW = 15.0

#: ``Policy.confirm_within``'s default, seconds.
CONFIRM_WITHIN = 300.0


class _Default(float):
    """``confirm_within`` left at its default: receipts are then simply not awaited for a
    receiver whose ``keep_for`` is too short, where a value set by hand is a ConfigError."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class Policy:
    """How deliveries on a queue are guarded.

    :param mode: ``"eager"`` claims the key before the handler and releases it if the handler
        fails; ``"lazy"`` checks before and marks only after success. Default ``"eager"``.
    :param lease: seconds a claim is held before another delivery may take it over; renewed by a
        heartbeat while the handler runs. Default 300.
    :param keep_for: seconds a handled key is remembered (the dedup window). Default 7 days.
    :param identity: ``"id+queue"`` (default) keys on queue and message id; ``"id"`` on the id.
    :param on_in_progress: ``"retry"`` (default) delivers a duplicate of a running message again
        after the lease's remaining time; ``"skip"`` acknowledges it at once.
    :param on_store_error: ``"fail_closed"`` (default) does not run the handler when the store is
        unreachable; ``"fail_open"`` runs it unguarded and emits ``store_error``.
    :param store_result: keep the handler's JSON result with the mark. Default False.
    :param check_payload: record a fingerprint of task name and arguments and refuse a delivery
        whose fingerprint differs under the same key. Default True.
    :param transactional: write the mark in the handler's own database transaction (SQL store,
        :func:`taskonce.current_session`). Default False.
    :param enabled: False turns the guard off for this queue/task. Default True.
    :param defer_sends: capture the messages the handler sends and publish them only after its
        outcome is recorded, together with it (the hand-off). False publishes them at once, as
        the framework does unguarded. Default True.
    :param check_first: look the key up before the handler runs. ``False`` (lazy and
        transactional only: *optimistic*) skips that look-up and relies on the key's unique
        constraint at commit: a first delivery costs no store round trip beyond its own
        transaction, and a duplicate runs, is rolled back and is reported as a duplicate.
        Default True.
    :param confirm_within: seconds after a deferred send's publish (or its ETA) within which its
        receiver's guard must have claimed or marked it; without that receipt the relay
        publishes it again under the same id, at most three times with back-off, then reports
        it (``send_unconfirmed``). Only for receivers guarded on the same store and known in
        the sending process. 0 turns receipts off for this queue's sends. Default 300. A value
        whose receipt window (15 × it) does not fit in half of ``keep_for`` is refused.
    :param crash_limit: how many times a key is taken over from an owner that died (or fell
        silent, or let its lease run out) and run again; the next such delivery quarantines the
        key instead (eager): not run, dead-lettered, later copies skipped until ``taskonce
        release KEY``. A message that kills its worker every time runs at most
        ``crash_limit + 1`` times. 0 turns quarantine off. Default 3.
    """

    mode: Mode = "eager"
    lease: float = 300.0
    keep_for: float = 7 * 86400.0
    identity: Identity = "id+queue"
    on_in_progress: OnInProgress = "retry"
    on_store_error: OnStoreError = "fail_closed"
    store_result: bool = False
    check_payload: bool = True
    transactional: bool = False
    enabled: bool = True
    defer_sends: bool = True
    check_first: bool = True
    confirm_within: float = _Default(CONFIRM_WITHIN)
    crash_limit: int = 3

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(
                    f"Policy.{name}={value!r} is not valid; choose one of {', '.join(choices)}"
                )
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(f"Policy.{name}={value!r} is not valid; it must be True or False")
        for name in _SECONDS:
            object.__setattr__(self, name, check_seconds(f"Policy.{name}", getattr(self, name)))
        self._check_confirm_within()
        check_count(
            "Policy.crash_limit", self.crash_limit, minimum=0, note="0 turns quarantine off"
        )
        if not self.check_first and (self.mode != "lazy" or not self.transactional):
            # Without the pre-check only the transaction's rollback stops a duplicate's effect:
            # eager claims first by design, and a lazy mark outside a transaction comes too late.
            raise ConfigError(
                f"Policy.check_first=False needs mode='lazy' and transactional=True (got "
                f"mode={self.mode!r}, transactional={self.transactional!r}): without the "
                "pre-check only the handler's transaction, rolled back at the key's unique "
                "constraint, stops a duplicate"
            )

    def _check_confirm_within(self) -> None:
        value = self.confirm_within
        if isinstance(value, _Default):
            return
        value = check_seconds("Policy.confirm_within", value, zero=True, note="0: no receipts")
        object.__setattr__(self, "confirm_within", value)
        window = RECEIPT_WINDOW * value
        if value and window > self.keep_for / 2:
            raise ConfigError(
                f"Policy.confirm_within={value:g} does not fit keep_for={self.keep_for:g}: a "
                f"receipt is looked for up to {RECEIPT_WINDOW:g} × confirm_within = {window:g} s "
                "after the publish, and the receiver's record must outlive that by far (half of "
                "keep_for at most); lower confirm_within, raise keep_for, or set "
                "confirm_within=0 (no receipts)"
            )

    def replace(self, **changes: Any) -> Policy:
        """A copy with ``changes`` applied; unknown fields raise :class:`ConfigError`."""
        unknown = sorted(set(changes) - FIELDS)
        if unknown:
            guesses = {
                name: close[0]
                for name in unknown
                if (close := difflib.get_close_matches(str(name), FIELDS, n=1))
            }
            if len(unknown) == 1 and guesses:
                hint = f" (did you mean {next(iter(guesses.values()))!r}?)"
            elif guesses:
                pairs = ", ".join(f"{close!r} for {name!r}" for name, close in guesses.items())
                hint = f" (did you mean {pairs}?)"
            else:
                hint = ""
            raise ConfigError(
                f"unknown Policy field(s) {', '.join(map(str, unknown))}{hint}; known: "
                f"{', '.join(sorted(FIELDS))}"
            )
        return dataclasses.replace(self, **changes)

    def overridden_by(self, override: Policy | Mapping[str, Any] | None) -> Policy:
        """This policy with a per-queue or per-task override applied.

        A :class:`Policy` replaces this one whole; a mapping changes only the fields it names.
        """
        if override is None:
            return self
        if isinstance(override, Policy):
            return override
        if isinstance(override, Mapping):
            return self.replace(**dict(override))
        raise ConfigError(
            f"an idempotency override must be a Policy or a dict of Policy fields, "
            f"not {type(override).__name__}"
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = frozenset(f.name for f in dataclasses.fields(Policy))


#: Dict overrides applied and kept per guard (:meth:`Policies.resolve`); the cache starts afresh
#: when full.
POLICY_CACHE = 1024


class Policies:
    """A guard's policies: the ``default``, one per named queue (a :class:`Policy`, or a dict
    of fields applied over the default), and per-task overrides applied over a queue's.

    :param check: raises :class:`ConfigError` for a policy the guard's store cannot serve; run
        on every policy given here and on every override resolved.
    """

    def __init__(
        self,
        default: Policy | Mapping[str, Any] | None,
        queues: Mapping[str, Policy | Mapping[str, Any]] | None,
        check: Callable[[Policy], None],
    ) -> None:
        self.default = Policy().overridden_by(default)
        self.queues: dict[str, Policy] = {}
        for queue, policy in (queues or {}).items():
            if not isinstance(queue, str) or not queue:
                raise ConfigError(
                    f"Guard(queues=…): queue name {queue!r} must be a non-empty string"
                )
            try:
                self.queues[queue] = self.default.overridden_by(policy)
            except ConfigError as exc:
                raise ConfigError(f"policy of queue {queue!r}: {exc}") from exc
        self._check = check
        self._cache: dict[tuple[str, frozenset[tuple[str, type, Any]]], Policy] = {}

    def check_all(self) -> None:
        """Run the check on the default and every queue's policy."""
        for policy in [self.default, *self.queues.values()]:
            self._check(policy)

    def resolve(self, queue: str, override: Policy | Mapping[str, Any] | None = None) -> Policy:
        """The policy in force for ``queue``, with a per-task ``override`` applied."""
        if override is None:
            return self.queues.get(queue, self.default)
        if isinstance(override, Policy):
            # A Policy replaces the queue's whole (Policy.overridden_by): nothing to apply or
            # cache. Adapters pass one on every delivery.
            self._check(override)
            return override
        cache_key = None
        if isinstance(override, Mapping):
            # A dict override is checked and applied once per (queue, its items); values are
            # told apart by type too, so {"enabled": 1} is refused even after {"enabled": True}.
            try:
                cache_key = (queue, frozenset((k, type(v), v) for k, v in override.items()))
                cached = self._cache.get(cache_key)
            except TypeError:  # an unhashable value: applied each time
                cache_key = cached = None
            if cached is not None:
                return cached
        policy = self.queues.get(queue, self.default).overridden_by(override)
        self._check(policy)
        if cache_key is not None:
            if len(self._cache) >= POLICY_CACHE:
                self._cache.clear()
            self._cache[cache_key] = policy
        return policy
