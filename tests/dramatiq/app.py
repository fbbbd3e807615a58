"""The Dramatiq application the real-worker tests run: a broker, a guard and the actors.

:func:`build` makes one from a :class:`Config`. The worker subprocess builds it from the
``TASKONCE_DQ_TEST_CONFIG`` environment variable (see ``worker_app.py``); the test process
builds its own copy with the same config to *send* messages (it never starts a worker).

Every actor takes the name of a PostgreSQL table as its first argument and records each of its
runs there (one row per run: message id, pid, attempt), so a test counts runs in a table of its
own and drops it afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import os
import re
import signal
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.encoder import PickleEncoder
from dramatiq.middleware import CurrentMessage, GroupCallbacks, Retries
from dramatiq.middleware.asyncio import AsyncIO
from dramatiq.rate_limits.backends import RedisBackend as RateLimiterRedisBackend
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend
from sqlalchemy import text

import taskonce
from taskonce.dramatiq_ext import IdempotencyMiddleware
from tests.typed_values import PARCEL, VALUES, wrong_types

CONFIG_ENV = "TASKONCE_DQ_TEST_CONFIG"
#: Queues of the receipts tests' children (``{namespace}_{name}``, actor ``r_{name}``), none
#: consumed by a worker started with ``queues=Harness.MAIN_QUEUES``.
RECEIPT_QUEUES = ("rchild", "rstep", "routbox", "rdown")
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclasses.dataclass
class Config:
    """Everything a worker of one test stack needs; passed to the worker as JSON."""

    broker: str  # redis://…/N or amqp://…
    namespace: str  # queue-name prefix (and the Redis broker's key namespace)
    store: str  # store URL
    events: str  # JSONL path for taskonce events
    acks: str  # JSONL path where the worker logs every ack/nack
    runs_url: str  # PostgreSQL (psycopg) URL of the run-count tables
    store_prefix: str | None = None
    store_table: str | None = None
    results: str | None = None  # Redis URL of the Results backend
    heartbeat_timeout: int = 60_000  # Redis broker: ms before a silent worker counts as dead
    maintenance_chance: int = 1000  # Redis broker: per million commands
    lease: float | None = 3.0  # the default policy's lease (s); None: the Policy's default
    store_error_backoff: int = 200  # ms before a fail_closed delivery is tried again
    start_timeout: float = 30.0  # s a worker process waits for the store at its start
    wrong_order: bool = False  # add the middleware before Retries (a bad-input test)
    #: declare ``wants_sql`` with idempotency={"transactional": True} (refused on a Redis store)
    bad_actor: bool = False
    #: give ``misconfigured`` that option as each of its messages is processed, after the boot
    #: checks passed (a configuration error met at run time)
    break_at_run: bool = False
    relay_every: float = 30.0  # the middleware's relay_every (s)
    confirm_within: float | None = None  # the default policy's (s); None: the Policy's default
    #: a taskonce.PrometheusEvents sink too, in processes with PROMETHEUS_MULTIPROC_DIR set
    prometheus: bool = False
    #: "pickle": Dramatiq's PickleEncoder (set process-wide by build(); the test restores it)
    encoder: str = "json"

    def to_env(self) -> dict[str, str]:
        return {CONFIG_ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls) -> Config:
        return cls(**json.loads(os.environ[CONFIG_ENV]))

    def queue(self, name: str) -> str:
        return f"{self.namespace}_{name}"

    @property
    def sql_store(self) -> bool:
        return not self.store.startswith(("redis", "memory"))


class AckLog(dramatiq.Middleware):
    """Appends one JSON line per ack/nack: the moment Dramatiq is done with a delivery (after
    every ``after_process_message``/``after_skip_message``, so after any Results write)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _log(self, message: Any, what: str) -> None:
        line = json.dumps(
            {"what": what, "message_id": message.message_id, "queue": message.queue_name}
        )
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)

    def after_ack(self, broker: dramatiq.Broker, message: Any) -> None:
        self._log(message, "ack")

    def after_nack(self, broker: dramatiq.Broker, message: Any) -> None:
        self._log(message, "nack")


class BreakAtRun(dramatiq.Middleware):
    """Runs before the guard: gives actor ``misconfigured`` an option no policy of a Redis
    store can take, as if the configuration had changed after the worker booted."""

    def __init__(self, guard_middleware: IdempotencyMiddleware) -> None:
        self.guard_middleware = guard_middleware

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        if message.actor_name == "misconfigured":
            broker.get_actor("misconfigured").options["idempotency"] = {"transactional": True}
            self.guard_middleware.policies.forget("misconfigured")


class KillAtEnqueue(dramatiq.Middleware):
    """Makes this worker process SIGKILL itself at the n-th enqueue after :func:`arm_kill`: an
    actor arms it just before returning, so those enqueues are the hand-off's dispatch, after
    its outcome is recorded (captured sends never reach ``enqueue``)."""

    plan: list[int] = []  # [n, enqueues so far]; process-wide: the dispatch runs in hooks

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: Any) -> None:
        plan = KillAtEnqueue.plan
        if plan:
            plan[1] += 1
            if plan[1] >= plan[0]:
                os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(at: int) -> None:
    KillAtEnqueue.plan[:] = [at, 0]


class Runs:
    """Per-thread autocommit connections to PostgreSQL for recording runs."""

    def __init__(self, url: str) -> None:
        self.url = url.replace("postgresql+psycopg://", "postgresql://")
        self._local = threading.local()

    def connection(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self.url, autocommit=True)
            self._local.conn = conn
        return conn

    def lock(self, release: bool = False) -> bool:
        """Take (or release) a session-level advisory lock named after the current message on
        this thread's connection: of two threads running it at once, exactly one takes it."""
        message = CurrentMessage.get_current_message()
        name = message.message_id if message is not None else "?"
        call = "pg_advisory_unlock" if release else "pg_try_advisory_lock"
        with self.connection().cursor() as cur:
            cur.execute(f"SELECT {call}(hashtext(%s))", (name,))
            row = cur.fetchone()
        return bool(row and row[0])

    def committed(self, table: str) -> int:
        """Committed rows of the current message in ``table`` (an effects table)."""
        if not _TABLE.match(table):
            raise ValueError(f"bad table name {table!r}")
        message = CurrentMessage.get_current_message()
        message_id = message.message_id if message is not None else "?"
        with self.connection().cursor() as cur:
            cur.execute(f"SELECT count(*) FROM {table} WHERE message_id = %s", (message_id,))
            row = cur.fetchone()
        return int(row[0]) if row else 0

    def record(self, table: str) -> int:
        """Insert one run of the current message; the number of runs of it so far."""
        if not _TABLE.match(table):
            raise ValueError(f"bad table name {table!r}")
        message = CurrentMessage.get_current_message()
        message_id = message.message_id if message is not None else "?"
        attempt = int(message.options.get("retries", 0)) if message is not None else 0
        with self.connection().cursor() as cur:
            cur.execute(
                f"INSERT INTO {table} (message_id, pid, attempt) VALUES (%s, %s, %s)",
                (message_id, os.getpid(), attempt),
            )
            cur.execute(f"SELECT count(*) FROM {table} WHERE message_id = %s", (message_id,))
            row = cur.fetchone()
        return int(row[0]) if row else 0


@dataclasses.dataclass
class App:
    config: Config
    broker: dramatiq.Broker
    guard: taskonce.Guard
    actors: dict[str, dramatiq.Actor[Any, Any]]
    results: RedisBackend | None


def make_broker(config: Config) -> dramatiq.Broker:
    if config.broker.startswith("amqp"):
        return RabbitmqBroker(url=config.broker)
    return RedisBroker(
        url=config.broker,
        namespace=config.namespace,
        heartbeat_timeout=config.heartbeat_timeout,
        maintenance_chance=config.maintenance_chance,
    )


def make_guard(config: Config) -> taskonce.Guard:
    options: dict[str, Any] = {}
    if config.store_prefix:
        options["prefix"] = config.store_prefix
    if config.store_table:
        options["table"] = config.store_table
    store = taskonce.open_store(config.store, **options)
    queues: dict[str, Any] = {
        config.queue("lazy"): {"mode": "lazy"},
        config.queue("open"): {"on_store_error": "fail_open"},
    }
    if config.sql_store:
        queues[config.queue("txn")] = {"transactional": True}
    default: dict[str, Any] = {}
    if config.lease is not None:
        default["lease"] = config.lease
    if config.confirm_within is not None:
        default["confirm_within"] = config.confirm_within
    events: list[Any] = [taskonce.JsonlEvents(config.events)]
    if config.prometheus and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        events.append(taskonce.PrometheusEvents())
    return taskonce.Guard(
        store,
        default=taskonce.Policy(**default),
        queues=queues,
        events=events,
        # A dead recorder's sends wait for its hold to run out (min(dispatch_lease, 10 s))
        # before a redelivery or the relay publishes them: 3 s here, so the crash tests wait
        # 3 s for it instead of 10; publishing takes milliseconds on loopback.
        dispatch_lease=3.0,
    )


def accepted(kind: type, **options: Any) -> dict[str, Any]:
    """The ``options`` that ``kind``'s constructor takes: the matrix's lowest Dramatiq (1.15)
    lacks some that the newest has, and the tests run on both (tools/matrix.py)."""
    parameters = inspect.signature(kind.__init__).parameters
    return {name: value for name, value in options.items() if name in parameters}


def build(config: Config) -> App:
    """The broker with its middleware, the guard and every actor of the tests."""
    if config.encoder == "pickle":
        dramatiq.set_encoder(PickleEncoder())
    broker = make_broker(config)
    guard = make_guard(config)
    results: RedisBackend | None = None
    if config.results:
        # Readable keys, so the tests can delete them; older Dramatiq (1.15) hashes every key
        # (its results then expire by their own TTL).
        results = RedisBackend(
            url=config.results,
            namespace=f"{config.namespace}-results",
            **accepted(RedisBackend, use_namespace_prefix_keys=True),
        )
        broker.add_middleware(Results(backend=results))
        # Group completion callbacks: a Redis barrier per group (its id is random), short-lived.
        barriers = RateLimiterRedisBackend(url=config.results)
        broker.add_middleware(
            GroupCallbacks(barriers, **accepted(GroupCallbacks, barrier_ttl=600_000))
        )
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(AsyncIO())
    broker.add_middleware(AckLog(config.acks))
    broker.add_middleware(KillAtEnqueue())
    if config.wrong_order:
        broker.add_middleware(IdempotencyMiddleware(guard), before=Retries)
    else:
        middleware = IdempotencyMiddleware(
            guard,
            store_error_min_backoff=config.store_error_backoff,
            store_error_max_backoff=config.store_error_backoff * 4,
            start_timeout=config.start_timeout,
            relay_every=config.relay_every,
        )
        broker.add_middleware(middleware)
        if config.break_at_run:
            broker.add_middleware(BreakAtRun(middleware), before=IdempotencyMiddleware)
    runs = Runs(config.runs_url)
    main, lazy, txn, opened = (config.queue(q) for q in ("main", "lazy", "txn", "open"))
    actors: dict[str, dramatiq.Actor[Any, Any]] = {}

    def actor(queue: str, name: str | None = None, **options: Any) -> Any:
        def register(fn: Any) -> Any:
            actor_name = name or fn.__name__
            actors[actor_name] = dramatiq.actor(
                fn, broker=broker, queue_name=queue, actor_name=actor_name, **options
            )
            return actors[actor_name]

        return register

    @actor(main, store_results=config.results is not None)
    def record(table: str, value: Any = None) -> str:
        """Counts its run; returns a fresh token (for the Results test)."""
        runs.record(table)
        return uuid.uuid4().hex

    @actor(main, max_retries=5, min_backoff=50, max_backoff=100)
    def flaky(table: str, fail_times: int) -> None:
        """Fails its first ``fail_times`` runs."""
        if runs.record(table) <= fail_times:
            raise RuntimeError("flaky: failing on purpose")

    @actor(main, idempotency={"lease": 2})
    def slow(table: str, seconds: float) -> None:
        runs.record(table)
        time.sleep(seconds)

    @actor(main, idempotency={"lease": 300})
    def short(table: str, seconds: float) -> None:
        """``slow`` with the Policy's default lease (300 s) instead of a short one, so how long
        a duplicate waits depends on the guard's choice, not on a lease of 2 s."""
        runs.record(table)
        time.sleep(seconds)

    @actor(main, max_retries=0)
    def crash_then(table: str, body: float) -> None:
        """The first run waits to be SIGKILLed; later runs take ``body`` seconds (the queue's
        own lease)."""
        time.sleep(60 if runs.record(table) == 1 else body)

    @actor(main, idempotency={"lease": 3}, max_retries=0)
    def crash(table: str) -> None:
        """The first run waits to be SIGKILLed; later runs return (``txn_crash``: the same,
        with an effect written through the guard's transaction first)."""
        if runs.record(table) == 1:
            time.sleep(60)

    @actor(main, max_retries=0)
    def crash_loop(table: str, heal_file: str) -> None:
        """Counts its run, then SIGKILLs its own worker process (an OOM kill, a segfaulting C
        extension) on every run until ``heal_file`` exists (crash-loop quarantine)."""
        runs.record(table)
        if not os.path.exists(heal_file):
            os.kill(os.getpid(), signal.SIGKILL)

    @actor(main, idempotency=False, max_retries=0)
    def crash_loop_unguarded(table: str) -> None:
        """``crash_loop`` without taskonce (the control)."""
        runs.record(table)
        os.kill(os.getpid(), signal.SIGKILL)

    @actor(txn, idempotency={"lease": 3}, max_retries=0)
    def txn_crash(table: str, effects: str, amount: int) -> None:
        _write_effect(effects, amount)
        if runs.record(table) == 1:
            time.sleep(60)

    @actor(lazy)
    def lazy_record(table: str) -> None:
        runs.record(table)

    @actor(main, idempotency={"mode": "lazy"})
    def per_actor(table: str) -> None:
        runs.record(table)

    @actor(main, idempotency=False)
    def not_guarded(table: str) -> None:
        runs.record(table)

    @actor(opened)
    def fail_open(table: str) -> None:
        runs.record(table)

    @actor(txn, max_retries=3, min_backoff=50, max_backoff=100)
    def txn_charge(table: str, effects: str, amount: int, fail_times: int = 0) -> None:
        _write_effect(effects, amount)
        if runs.record(table) <= fail_times:
            raise RuntimeError("txn_charge: failing after the write, on purpose")

    @actor(main, idempotency=taskonce.Policy(mode="eager", lease=3))
    async def async_record(table: str) -> None:
        await asyncio.sleep(0.01)
        runs.record(table)

    @actor(txn)
    async def async_txn(table: str, effects: str, amount: int) -> None:
        await asyncio.sleep(0.01)
        _write_effect(effects, amount)  # needs the worker thread's context in the task
        runs.record(table)

    @actor(main)
    def misconfigured(table: str) -> None:
        runs.record(table)

    if config.bad_actor:

        @actor(main, idempotency={"transactional": True})
        def wants_sql(table: str) -> None:
            runs.record(table)

    # -- the hand-off: actors that send, and crashes in the middle of enqueueing -------------

    @actor(main)
    def child(table: str, label: str) -> None:
        """A guarded child: one row per run in ``table`` (under its message id)."""
        runs.record(table)

    @actor(main, max_retries=3, min_backoff=50, max_backoff=100)
    def sender(
        table: str,
        children: str,
        n: int,
        kill_at: int = 0,
        die_in_body: bool = False,
        fails: int = 0,
        fail_for_good: bool = False,
        odd_argument: bool = False,
    ) -> str:
        """Sends ``n`` children, then (first run only) dies in the body, fails, or arms a kill
        at the ``kill_at``-th enqueue of its hand-off."""
        run = runs.record(table)
        for i in range(n):
            actors["child"].send(children, f"child-{i}")
        if odd_argument:
            actors["child"].send(children, {"a", "set"})  # not JSON: refused at this call
        if die_in_body and run == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if fail_for_good:
            raise RuntimeError("sender fails for good")
        if run <= fails:
            raise RuntimeError(f"sender run {run} fails on purpose")
        if kill_at and run == 1:
            arm_kill(kill_at)
        return "sent"

    @actor(main)
    async def async_sender(table: str, children: str, n: int, kill_at: int = 0) -> None:
        await asyncio.sleep(0.01)
        run = runs.record(table)
        for i in range(n):
            actors["child"].send(children, f"child-{i}")
        if kill_at and run == 1:
            arm_kill(kill_at)

    @actor(main)
    def on_done(message_data: dict[str, Any], result: Any) -> None:
        """An ``on_success`` callback: one row in the parent's ``children`` table."""
        runs.record(message_data["args"][1])

    @actor(main)
    def member(table: str, kill_at: int = 0) -> str:
        """A group member: one row per run; its first run arms a kill at the ``kill_at``-th
        enqueue of its hand-off (only the member that completes the group enqueues anything:
        the group's completion callback)."""
        run = runs.record(table)
        if kill_at and run == 1:
            arm_kill(kill_at)
        return "member"

    @actor(main)
    def pipe_step(table: str, kill_at: int, previous: Any = None) -> int:
        """A pipeline step: one row per run; its first run dies enqueueing the next step."""
        run = runs.record(table)
        if kill_at and run == 1:
            arm_kill(kill_at)
        return int(previous or 0) + 1

    # -- receipts: children on queues of their own (see RECEIPT_QUEUES) --------------------

    def receiver(queue: str) -> Any:
        @actor(config.queue(queue), name=f"r_{queue}")
        def receive(table: str, label: str = "", previous: Any = None) -> None:
            """A guarded child that counts its run (``previous``: a pipeline's last result)."""
            runs.record(table)

        return receive

    for name in RECEIPT_QUEUES:
        receiver(name)

    def send_to(table: str, label: str, actor_name: str, delay: int = 0) -> None:
        """Sends ``actor_name(table, label)`` (``delay`` ms later, if given)."""
        runs.record(table)
        actors[actor_name].send_with_options(args=(table, label), delay=delay or None)

    actor(main, name="r_send")(send_to)

    @actor(main, name="r_retrying", max_retries=2, min_backoff=3000, max_backoff=3000)
    def retrying(table: str, label: str) -> None:
        """Fails every run and is retried by Dramatiq (1.5 to 3 s later), twice: three runs,
        then dead-lettered."""
        runs.record(table)
        raise RuntimeError("r_retrying fails on purpose")

    # its sends are looked for after 1 s (the receipts' tries in 15 s)
    actor(main, name="r_send_1s", idempotency={"confirm_within": 1.0})(send_to)

    @actor(main, idempotency=False)
    def ping(table: str) -> None:
        runs.record(table)

    @actor(lazy, idempotency=False)
    def ping_lazy(table: str) -> None:
        runs.record(table)

    @actor(opened, idempotency=False)
    def ping_open(table: str) -> None:
        runs.record(table)

    if config.sql_store:

        @actor(txn, idempotency=False)
        def ping_txn(table: str) -> None:
            runs.record(table)

        @actor(
            txn,
            idempotency={"mode": "lazy", "transactional": True, "check_first": False},
            max_retries=0,
        )
        def opt_charge(
            table: str,
            effects: str,
            amount: int,
            hang_first: bool = False,
            wait_other: bool = False,
        ) -> None:
            """Optimistic (check_first=False): writes its effect through the guard's
            transaction; the first run hangs (to be SIGKILLed). With ``wait_other`` one of two
            concurrent runs (the one that takes an advisory lock on the message id) holds its
            uncommitted row until the other has committed its own, and fails if that never
            happens."""
            _write_effect(effects, amount)
            run = runs.record(table)
            if hang_first and run == 1:
                time.sleep(60)
            if wait_other and runs.lock():
                try:
                    deadline = time.monotonic() + 60
                    while runs.committed(effects) == 0:
                        if time.monotonic() > deadline:
                            raise RuntimeError("no other run of this message committed meanwhile")
                        time.sleep(0.05)
                finally:
                    runs.lock(release=True)

        # opt_charge with the look-up before the actor (check_first, the default): two copies
        # at once both pass it, so the one that marks second is rolled back
        actor(
            txn,
            name="checked_charge",
            idempotency={"mode": "lazy", "transactional": True},
            max_retries=0,
        )(opt_charge.fn)

    # -- serializers and argument types (tests/dramatiq/test_serializers.py) ----------------

    @actor(main, max_retries=0)
    def typed(table: str, label: str, *values: Any) -> None:
        """Takes the four values of tests.typed_values.VALUES and the PARCEL; counts its run
        only when they arrived as they were sent (else it fails: no row)."""
        wrong = wrong_types(values, (*VALUES, PARCEL))
        if wrong:
            raise TypeError(f"{label}: {wrong}")
        runs.record(table)

    @actor(main, max_retries=0)
    def typed_sender(table: str, children: str) -> None:
        """Sends ``typed`` with the values and the parcel from its body, and a pipeline of two."""
        runs.record(table)
        actors["typed"].send(children, "sent", *VALUES, PARCEL)
        step = actors["typed"].message_with_options(
            args=(children, "piped", *VALUES, PARCEL), pipe_ignore=True
        )
        dramatiq.pipeline([step, step.copy(message_id=str(uuid.uuid4()))], broker=broker).run()

    return App(config, broker, guard, actors, results)


def _write_effect(table: str, amount: int) -> None:
    if not _TABLE.match(table):
        raise ValueError(f"bad table name {table!r}")
    session = taskonce.current_session()
    message = CurrentMessage.get_current_message()
    session.execute(
        text(f"INSERT INTO {table} (message_id, amount) VALUES (:m, :a)"),
        {"m": message.message_id if message else "?", "a": amount},
    )
