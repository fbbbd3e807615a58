"""The Celery app the worker subprocesses of the Celery tests run, configured by environment.

``TO_BROKER``, ``TO_BACKEND``: broker and result backend URLs. ``TO_PREFIX``: this run's
prefix (queue names ``{prefix}.eager``, ``.lazy``, ``.tx``, ``.off``, ``.plain`` and the Redis
``global_keyprefix``). ``TO_STORE`` / ``TO_STORE_NS``: the taskonce store and its prefix (Redis)
or table (SQL). ``TO_EVENTS``: JSONL events file. ``TO_PG``: the PostgreSQL URL of the run-count
tables. ``TO_LEASE``: lease of the guarded queues (``default``: the Policy's). ``TO_VISIBILITY``: Redis visibility timeout.
``TO_STORE_RETRY_DELAY``: ``taskonce_store_retry_delay``. ``TO_START_TIMEOUT``:
``taskonce_start_timeout``. ``TO_RELAY_EVERY``: ``taskonce_relay_every``.
``TO_CONFIRM_WITHIN``: the default policy's ``confirm_within`` (receipts). ``TO_SERIALIZER``:
the app's task and result serializer (default kombu's JSON). ``TO_PROMETHEUS=1``:
a :class:`taskonce.PrometheusEvents` sink too (set ``PROMETHEUS_MULTIPROC_DIR``).
``TO_READY``: file written when the worker is ready.

Configuration-error switches (each test of them uses its own worker): ``TO_BAD_TASK=1`` declares
``t.wants_sql`` with ``idempotency={"transactional": True}`` (the worker must refuse to start on
a Redis store); ``TO_BY_SETTINGS=1`` configures the guard through the ``taskonce_*`` settings
instead of ``setup()``; ``TO_BREAK_AT_RUN=1`` gives ``t.misconfigured`` that same option in each
pool process after the start checks passed (a configuration error met at run time);
``TO_DLX=1`` declares the ``{prefix}.eager`` queue with a dead-letter queue ``{prefix}.dead``;
``TO_QUORUM=1`` declares ``{prefix}.eager`` a quorum queue (``TO_DELIVERY_LIMIT``: its
``x-delivery-limit``, dead-lettering into ``{prefix}.dead``); an ``sqs://`` broker gets the
SQS transport options of tests/celery/test_sqs.py. ``TO_SETTINGS_TYPO=1`` configures through the settings with a misspelt policy field and calls
``setup(app)`` while the module is imported.

Every task counts its runs in the PostgreSQL table whose name it is given (one row per run,
committed before the body goes on), so a test reads run counts from the database, not memory.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import kombu.messaging
from celery import Celery, chord, group, signals
from sqlalchemy.exc import IntegrityError

import taskonce
from taskonce.celery_ext import IdempotentTask, setup

ENV = os.environ
PREFIX = ENV.get("TO_PREFIX", "tc")
BROKER = ENV.get("TO_BROKER", "memory://")
STORE = ENV.get("TO_STORE", "memory://")
STORE_NS = ENV.get("TO_STORE_NS", PREFIX)
LEASE = ENV.get("TO_LEASE", "3")  # "default": the Policy's own default lease
PG = ENV.get("TO_PG", "postgresql://postgres@127.0.0.1:5432/test").replace(
    "postgresql+psycopg://", "postgresql://"
)

EAGER_Q, LAZY_Q, TX_Q, OFF_Q, PLAIN_Q = (
    f"{PREFIX}.{name}" for name in ("eager", "lazy", "tx", "off", "plain")
)
SQL_STORE = STORE.startswith(("postgresql", "sqlite", "mysql"))

app = Celery("app_under_test", broker=BROKER, backend=ENV.get("TO_BACKEND") or None)
transport: dict[str, Any] = {}
if BROKER.startswith("redis"):
    transport["global_keyprefix"] = f"{PREFIX}:"
    if ENV.get("TO_VISIBILITY"):
        transport.update(
            visibility_timeout=float(ENV["TO_VISIBILITY"]),
            unacked_restore_interval=1,
            unacked_restore_throttle=1,
        )
if BROKER.startswith("sqs"):
    # Amazon SQS (tests/celery/test_sqs.py: moto's server on loopback, plain HTTP): messages
    # come back after TO_VISIBILITY seconds unacknowledged; short polls keep the tests quick.
    transport.update(
        region="us-east-1",
        is_secure=False,
        visibility_timeout=float(ENV.get("TO_VISIBILITY", "30")),
        wait_time_seconds=0,
        polling_interval=0.1,
    )
app.conf.update(
    broker_transport_options=transport,
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
    result_expires=3600,
    task_default_queue=EAGER_Q,
    worker_prefetch_multiplier=1,
    worker_lost_wait=1.0,  # report a killed pool process's job promptly (default 10 s)
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    taskonce_store_retry_delay=float(ENV.get("TO_STORE_RETRY_DELAY", "1")),
    taskonce_relay_every=float(ENV.get("TO_RELAY_EVERY", "30")),
    taskonce_start_timeout=float(ENV.get("TO_START_TIMEOUT", "30")),
)
if ENV.get("TO_SERIALIZER"):  # e.g. "pickle": the app's task and result serializer
    app.conf.update(
        task_serializer=ENV["TO_SERIALIZER"],
        result_serializer=ENV["TO_SERIALIZER"],
        accept_content=[ENV["TO_SERIALIZER"], "json"],
        result_accept_content=[ENV["TO_SERIALIZER"], "json"],
    )

queues: dict[str, Any] = {
    LAZY_Q: {"mode": "lazy"},
    OFF_Q: {"enabled": False},
}
if SQL_STORE:
    queues[TX_Q] = {"transactional": True}
store_options = {"table": STORE_NS} if SQL_STORE else {"prefix": STORE_NS}
if STORE.startswith("memory"):
    store_options = {}
if ENV.get("TO_DLX"):
    from tests.celery.queues import dead_lettered_queue

    app.conf.task_queues = [dead_lettered_queue(PREFIX)]
if ENV.get("TO_QUORUM"):  # RabbitMQ quorum queues (tests/celery/test_quorum.py)
    from tests.celery.queues import quorum_queue

    app.conf.task_queues = [quorum_queue(PREFIX, int(ENV.get("TO_DELIVERY_LIMIT", "0")))]
DEFAULT_POLICY: dict[str, Any] = (
    {"mode": "eager"} if LEASE == "default" else {"mode": "eager", "lease": float(LEASE)}
)
if ENV.get("TO_CONFIRM_WITHIN"):
    DEFAULT_POLICY["confirm_within"] = float(ENV["TO_CONFIRM_WITHIN"])
if ENV.get("TO_SETTINGS_TYPO"):
    app.conf.update(taskonce_store=STORE, taskonce_default={"mdoe": "lazy"})
    setup(app)  # raises while `celery worker` imports this module
if ENV.get("TO_BY_SETTINGS"):
    app.conf.update(
        taskonce_store=taskonce.open_store(STORE, **store_options),
        taskonce_default=DEFAULT_POLICY,
        taskonce_queues=queues,
        taskonce_events=ENV.get("TO_EVENTS"),
    )
else:
    GUARD = taskonce.Guard(
        taskonce.open_store(STORE, **store_options),
        default=DEFAULT_POLICY,
        queues=queues,
        events=[
            *([taskonce.JsonlEvents(ENV["TO_EVENTS"])] if ENV.get("TO_EVENTS") else []),
            *([taskonce.PrometheusEvents()] if ENV.get("TO_PROMETHEUS") else []),
        ],
        # A dead recorder's sends wait for its hold to run out (min(dispatch_lease, 10 s))
        # before a redelivery or the relay publishes them: 3 s here, so the crash tests wait
        # 3 s for it instead of 10; publishing takes milliseconds on loopback.
        dispatch_lease=3.0,
    )
    setup(app, GUARD)

# -- run counting (one autocommit psycopg connection per process, opened after the fork) -------

_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_conn: dict[int, Any] = {}


def _db() -> Any:
    import psycopg

    pid = os.getpid()
    conn = _conn.get(pid)
    if conn is None or conn.closed:
        conn = psycopg.connect(PG, autocommit=True)
        _conn.clear()
        _conn[pid] = conn
    return conn


def count_run(table: str, task: Any, label: str) -> int:
    """Record one run of ``label``; return how many runs of it there have been."""
    if not _TABLE.match(table):
        raise ValueError(f"bad table name {table!r}")
    request = task.request
    with _db().cursor() as cur:
        cur.execute(
            f"INSERT INTO {table} (label, task_id, retries, pid) VALUES (%s, %s, %s, %s)",
            (label, request.id, request.retries or 0, os.getpid()),
        )
        cur.execute(f"SELECT count(*) FROM {table} WHERE label = %s", (label,))
        row = cur.fetchone()
    return int(row[0])


# -- tasks ------------------------------------------------------------------------------------


def guarded_task(**options: Any) -> Any:
    """``app.task`` for this module's guarded tasks: bound, ``IdempotentTask``, not shared. A
    shared task joins every Celery app created later in the same process: a test that imports
    this module would hand its tasks (and their ``idempotency`` options) to the apps of the
    tests after it, whose queue policies may refuse them."""
    return app.task(shared=False, base=IdempotentTask, bind=True, **options)


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.record")
def record(self: Any, table: str, label: str, sleep: float = 0.0, hang_first: bool = False) -> str:
    runs = count_run(table, self, label)
    if hang_first and runs == 1:
        time.sleep(120)  # the test SIGKILLs this child
    if sleep:
        time.sleep(sleep)
    return label


@app.task(base=IdempotentTask, shared=False, name="t.bare")  # as a user writes it: no options
def bare(table: str, label: str, hang_first: bool = False) -> str:
    """Counts its run; the first run hangs (the test SIGKILLs its pool process)."""
    if count_run(table, bare, label) == 1 and hang_first:
        time.sleep(120)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.crash")
def crash(self: Any, table: str, label: str, heal_file: str = "") -> str:
    """Counts its run, then SIGKILLs its own pool process (an OOM kill, a segfaulting C
    extension) on every run, until ``heal_file`` exists (crash-loop quarantine)."""
    count_run(table, self, label)
    if not (heal_file and os.path.exists(heal_file)):
        os.kill(os.getpid(), signal.SIGKILL)
    return label


@app.task(
    shared=False, bind=True, acks_late=True, reject_on_worker_lost=True, name="t.crash_unguarded"
)
def crash_unguarded(self: Any, table: str, label: str) -> str:
    """``t.crash`` without taskonce (the control): Celery redelivers it after every kill."""
    count_run(table, self, label)
    os.kill(os.getpid(), signal.SIGKILL)
    return label


@guarded_task(acks_late=True, idempotency={"lease": 300.0}, name="t.record_default_lease")
def record_default_lease(self: Any, table: str, label: str, sleep: float = 0.0) -> str:
    """``t.record`` with the Policy's default lease (300 s) instead of the stack's short one,
    so how long a duplicate waits depends on the guard's choice, not on a lease of 3 s."""
    count_run(table, self, label)
    if sleep:
        time.sleep(sleep)
    return label


@guarded_task(acks_late=True, max_retries=5, name="t.flaky")
def flaky(self: Any, table: str, label: str, fails: int) -> dict[str, Any]:
    count_run(table, self, label)
    if self.request.retries < fails:
        raise self.retry(countdown=0)
    return {"label": label, "attempts": self.request.retries + 1}


@guarded_task(
    acks_late=True,
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0, "max_retries": 5},
    name="t.auto",
)
def auto(self: Any, table: str, label: str, fails: int) -> dict[str, Any]:
    count_run(table, self, label)
    if self.request.retries < fails:
        raise ValueError(f"attempt {self.request.retries} fails on purpose")
    return {"label": label, "attempts": self.request.retries + 1}


@guarded_task(acks_late=True, name="t.chain_a")
def chain_a(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return f"{label}-a"


@app.task(shared=False, bind=True, acks_late=True, name="t.chain_b")  # a plain task: not guarded
def chain_b(self: Any, value: str, table: str) -> str:
    count_run(table, self, value)
    return f"{value}-b"


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.effect")
def effect(
    self: Any,
    table: str,
    effects: str,
    label: str,
    hang_first: bool = False,
    fail_first: bool = False,
    sleep_first: float = 0.0,
) -> str:
    """Write one row into ``effects`` through the guard's transaction (the first run waits
    ``sleep_first`` seconds before returning)."""
    from sqlalchemy import text

    if not _TABLE.match(effects):
        raise ValueError(f"bad table name {effects!r}")
    runs = count_run(table, self, label)
    session = taskonce.current_session()
    session.execute(text(f"INSERT INTO {effects} (label) VALUES (:label)"), {"label": label})
    if hang_first and runs == 1:
        time.sleep(120)  # the test SIGKILLs this child: the insert above never commits
    if sleep_first and runs == 1:
        time.sleep(sleep_first)  # the test SIGSTOPs this child meanwhile
    if fail_first and runs == 1:
        raise self.retry(countdown=0)  # rolls the insert back, releases the claim
    return label


@guarded_task(
    acks_late=True,
    autoretry_for=(IntegrityError,),
    retry_kwargs={"countdown": 0, "max_retries": 1},
    name="t.effect_autoretry",
)
def effect_autoretry(self: Any, table: str, effects: str, label: str) -> str:
    """``t.effect`` retried once on an ``IntegrityError`` (``autoretry_for``): also one its
    transaction's commit raises (a constraint checked at commit)."""
    from sqlalchemy import text

    if not _TABLE.match(effects):
        raise ValueError(f"bad table name {effects!r}")
    count_run(table, self, label)
    session = taskonce.current_session()
    session.execute(text(f"INSERT INTO {effects} (label) VALUES (:label)"), {"label": label})
    return label


if SQL_STORE:
    # Declared on SQL stores only: a transactional option is refused at start on Redis.

    def _effect(
        task: Any,
        table: str,
        effects: str,
        label: str,
        hang_first: bool = False,
        wait_other: bool = False,
    ) -> str:
        """Counts its run, writes one row into ``effects`` through the guard's transaction; the
        first run hangs (to be SIGKILLed). With ``wait_other`` one of two concurrent runs (the
        one that takes an advisory lock on the task id) holds its uncommitted row until the
        other has committed its own, and fails if that never happens."""
        from sqlalchemy import text

        if not _TABLE.match(effects):
            raise ValueError(f"bad table name {effects!r}")
        runs = count_run(table, task, label)
        session = taskonce.current_session()
        session.execute(text(f"INSERT INTO {effects} (label) VALUES (:label)"), {"label": label})
        if hang_first and runs == 1:
            time.sleep(120)  # the test SIGKILLs this child: the insert above never commits
        if wait_other and _lock(task.request.id):
            try:
                deadline = time.monotonic() + 60
                while _committed(effects, label) == 0:
                    if time.monotonic() > deadline:
                        raise RuntimeError("no other run of this label committed meanwhile")
                    time.sleep(0.05)
            finally:
                _lock(task.request.id, release=True)
        return label

    for name, policy in (
        # optimistic: no look-up before the body
        ("t.opt_effect", {"mode": "lazy", "transactional": True, "check_first": False}),
        # the look-up before the body: two copies at once both pass it
        ("t.txn_effect", {"mode": "lazy", "transactional": True}),
    ):
        app.task(
            base=IdempotentTask,
            bind=True,
            acks_late=True,
            reject_on_worker_lost=True,
            idempotency=policy,
            name=name,
        )(_effect)


def _lock(name: str, release: bool = False) -> bool:
    """Take (or release) a session-level advisory lock named ``name`` on this process's
    connection: of two processes running at once, exactly one takes it."""
    call = "pg_advisory_unlock" if release else "pg_try_advisory_lock"
    with _db().cursor() as cur:
        cur.execute(f"SELECT {call}(hashtext(%s))", (name,))
        row = cur.fetchone()
    return bool(row[0])


def _committed(effects: str, label: str) -> int:
    """Committed rows of ``label`` in ``effects`` (read outside the guard's transaction)."""
    with _db().cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {effects} WHERE label = %s", (label,))
        row = cur.fetchone()
    return int(row[0])


@guarded_task(acks_late=True, idempotency={"mode": "eager"}, name="t.override")
def override(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return label


@guarded_task(acks_late=False, name="t.noack")  # the worker warns about it at start
def noack(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return label


@guarded_task(acks_late=True, name="t.misconfigured")
def misconfigured(self: Any, table: str, label: str) -> str:
    count_run(table, self, label)
    return label


if ENV.get("TO_BAD_TASK"):

    @guarded_task(acks_late=True, idempotency={"transactional": True}, name="t.wants_sql")
    def wants_sql(self: Any, table: str, label: str) -> str:
        count_run(table, self, label)
        return label


@signals.worker_process_init.connect
def _break_at_run(**_: Any) -> None:
    if ENV.get("TO_BREAK_AT_RUN"):
        misconfigured.idempotency = {"transactional": True}


# -- the hand-off: tasks that send, and a crash in the middle of publishing -------------------


class FlakyError(Exception):
    """What ``t.sender`` retries on (not ValueError: a refused send is one, and must fail)."""


#: [n, publishes so far]: this pool process SIGKILLs itself at its n-th publish (see arm_kill).
_KILL: list[int] = []


def arm_kill(at: int) -> None:
    """Die (SIGKILL, no clean-up) at the ``at``-th publish of this process from now on: the
    body arms it just before returning, so the publishes are the hand-off's dispatch, after the
    outcome is recorded."""
    _KILL[:] = [at, 0]


_publish = kombu.messaging.Producer.publish


def _die_at_nth_publish(producer: Any, *args: Any, **kwargs: Any) -> Any:
    """kombu's publish, counted: what reaches the broker (a guarded body's sends are made —
    ``before_task_publish`` and all — when it sends them, and reach the broker after its
    outcome is recorded)."""
    if _KILL:
        _KILL[1] += 1
        if _KILL[1] >= _KILL[0]:
            os.kill(os.getpid(), signal.SIGKILL)
    return _publish(producer, *args, **kwargs)


kombu.messaging.Producer.publish = _die_at_nth_publish  # type: ignore[method-assign]


@signals.task_postrun.connect
def _disarm(**_: Any) -> None:
    _KILL.clear()


@guarded_task(
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=(FlakyError,),
    retry_kwargs={"countdown": 0, "max_retries": 5},
    name="t.sender",
)
def sender(
    self: Any,
    table: str,
    label: str,
    children: list[str],
    kill_at: int = 0,
    die_in_body: bool = False,
    fails: int = 0,
    fail_for_good: bool = False,
    odd_argument: bool = False,
) -> str:
    """Sends ``t.record(table, child)`` for each child label, then (first run only) dies in the
    body, fails, or arms a kill at the ``kill_at``-th publish of the hand-off."""
    runs = count_run(table, self, label)
    for child in children:
        record.delay(table, child)
    if odd_argument:
        record.delay(table, {"a", "set"})  # not JSON: refused at this call
    if die_in_body and runs == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if fail_for_good:
        raise RuntimeError("sender fails for good")
    if runs <= fails:
        raise FlakyError(f"sender run {runs} fails on purpose")
    if kill_at and runs == 1:
        arm_kill(kill_at)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.step")
def step(self: Any, previous: Any, table: str, label: str, kill_at: int = 0) -> str:
    """A chain step (or chord body): counts its run, returns ``previous>label``; its first run
    dies at the ``kill_at``-th publish of its hand-off (the next chain step)."""
    runs = count_run(table, self, label)
    if kill_at and runs == 1:
        arm_kill(kill_at)
    return f"{previous}>{label}"


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.canvas")
def canvas(self: Any, table: str, label: str, kind: str, kill_at: int = 0) -> str:
    """Sends a group of three ``t.record`` (or a chord of them into ``t.step``)."""
    runs = count_run(table, self, label)
    header = [record.si(table, f"{label}-{i}") for i in range(3)]
    if kind == "group":
        group(header).apply_async()
    else:
        chord(header)(step.s(table, f"{label}-body"))
    if kill_at and runs == 1:
        arm_kill(kill_at)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.tx_sender")
def tx_sender(self: Any, table: str, effects: str, label: str, child: str) -> str:
    """Transactional: writes a row through the guard's transaction and sends a child; its first
    run dies before the commit (the row, the mark and the send never land)."""
    from sqlalchemy import text

    if not _TABLE.match(effects):
        raise ValueError(f"bad table name {effects!r}")
    runs = count_run(table, self, label)
    session = taskonce.current_session()
    session.execute(text(f"INSERT INTO {effects} (label) VALUES (:label)"), {"label": label})
    record.delay(table, child)
    if runs == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, max_retries=3, name="t.part")
def part(self: Any, table: str, label: str, kill_at: int = 0, fail_first: bool = False) -> str:
    """A chord header task: counts its run; its first run fails and is retried (``fail_first``)
    or, successful, arms a kill at the ``kill_at``-th publish of its hand-off (only the header
    task that completes the chord publishes anything: the chord body)."""
    runs = count_run(table, self, label)
    if fail_first and runs == 1:
        raise self.retry(countdown=0)
    if kill_at and runs == 1:
        arm_kill(kill_at)
    return label


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.replacer")
def replacer(
    self: Any,
    table: str,
    label: str,
    children: list[str],
    then: str,
    then_children: list[str],
    fail_before: bool = False,
    kill_at: int = 0,
) -> Any:
    """Sends ``t.record`` for each child, then replaces itself with ``t.sender(table, then,
    then_children)`` (which sends its own children). ``fail_before``: fails before the replace;
    ``kill_at``: (first run) dies at the ``kill_at``-th publish from the replace on (1: the
    replacement, 2: the first of the sends made before it)."""
    runs = count_run(table, self, label)
    for child in children:
        record.delay(table, child)
    if fail_before:
        raise RuntimeError("replacer fails before replace()")
    if kill_at and runs == 1:
        arm_kill(kill_at)
    return self.replace(sender.si(table, then, then_children))


@guarded_task(acks_late=False, name="t.early_sender")
def early_sender(self: Any, table: str, label: str, child: str) -> str:
    """Acknowledged before it runs (no acks_late); its first run dies in the hand-off."""
    runs = count_run(table, self, label)
    record.delay(table, child)
    if runs == 1:
        arm_kill(1)
    return label


# -- receipts: a child sent to a queue of the test's choosing ---------------------------------


def _send_to(
    self: Any,
    table: str,
    label: str,
    queue: str,
    child: str,
    countdown: float = 0.0,
    task: str = "t.record",
) -> str:
    """Sends ``task(table, child)`` (``t.record`` by default) to ``queue`` (``countdown``
    seconds later, if given)."""
    count_run(table, self, label)
    app.tasks[task].apply_async((table, child), queue=queue, countdown=countdown or None)
    return label


send_to = app.task(base=IdempotentTask, bind=True, acks_late=True, name="t.send_to")(_send_to)
#: ``t.send_to`` whose sends are looked for after 1 s (the receipts' tries in 15 s)
send_to_1s = app.task(
    base=IdempotentTask,
    bind=True,
    acks_late=True,
    idempotency={"confirm_within": 1.0},
    name="t.send_to_1s",
)(_send_to)


@guarded_task(acks_late=True, max_retries=2, name="t.retrying")
def retrying(self: Any, table: str, label: str) -> str:
    """Fails every run and retries 3 s later, twice: three runs, then it fails for good."""
    count_run(table, self, label)
    raise self.retry(countdown=3)


@signals.worker_ready.connect
def _ready(**_: Any) -> None:
    path = ENV.get("TO_READY")
    if path:
        Path(path).write_text(str(os.getpid()))


# -- serializers and argument types (tests/celery/test_serializers.py) ------------------------

import tests.celery.typed_tasks  # noqa: E402, F401  (registers t.typed* on this app)
