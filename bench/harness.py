"""What every benchmark shares: servers of its own, timing, CPU meters, and its docs block.

- :class:`RedisServer`: a throwaway redis-server on a free loopback port (nothing else's
  commands in its counters); :func:`wait_until`; :func:`stop_group` for a worker started in
  its own session.
- :func:`interleaved`, :func:`cpu_wall`, :func:`med`: rounds whose order alternates, so machine
  noise hits every variant alike; per-call client CPU (``time.process_time``) and wall time.
- :func:`pid_cpu`, :func:`group_cpu`, :class:`StoreMeter`: CPU of processes from ``/proc`` and a
  redis-server's own account of its work (``INFO commandstats``).
- :func:`write_block`: a benchmark writes only its generated block of a doc, between
  ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; the prose around it is the doc's own.
  :func:`measured_line` is the block's last line (when, where, load, the command).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "docs" / "performance.md"
PG_URL = os.environ.get("TASKONCE_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
T = TypeVar("T")

# -- servers and processes --------------------------------------------------------------------


def wait_until(check: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """``check()``'s first truthy value; ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A redis-server of the benchmark's own on a free loopback port; no persistence, or with
    ``folder`` an append-only file (``everysec``) in ``folder/name``, as a deployed one."""

    def __init__(self, folder: Path | None = None, name: str = "redis") -> None:
        self.folder, self.name = folder, name
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server is not installed")
        self.port = free_port()
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.folder is None:
            argv += ["--appendonly", "no"]
        else:
            (self.folder / self.name).mkdir(parents=True, exist_ok=True)
            argv += ["--dir", str(self.folder / self.name), "--logfile", "redis.log"]
            argv += ["--appendonly", "yes", "--appendfsync", "everysec"]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def answers() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(answers, 10, f"redis-server {self.name}")
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.kill()


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """Stop a process started with ``start_new_session=True`` and all of its group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
            process.wait(timeout=10)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def drop_keys(client: Any, prefix: str) -> None:
    """Delete every key under ``prefix:`` (a benchmark's own prefix)."""
    names = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    for i in range(0, len(names), 1000):
        client.delete(*names[i : i + 1000])


@contextlib.contextmanager
def counted_writes() -> Iterator[list[int]]:
    """``[n]``: writes to any redis-py connection meanwhile, each one round trip whatever it
    carries (the store sends its scripts down a connection it keeps, not the command path)."""
    import redis.connection

    cls, count = redis.connection.AbstractConnection, [0]
    original = cls.send_packed_command

    def counting(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(self, command, *args, **kwargs)

    cls.send_packed_command = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        cls.send_packed_command = original  # type: ignore[method-assign]


# -- timing -----------------------------------------------------------------------------------


def interleaved(rounds: int, variants: Sequence[T]) -> Iterable[tuple[int, T]]:
    """(round, variant) for every round, the order reversed every other round."""
    for round_no in range(rounds):
        for variant in variants if round_no % 2 == 0 else list(reversed(variants)):
            yield round_no, variant


def cpu_wall(fn: Callable[[str], object], keys: Sequence[str]) -> tuple[float, float]:
    """(client CPU µs, wall µs) per call of ``fn`` over ``keys``."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for key in keys:
        fn(key)
    n = len(keys)
    return (time.process_time() - cpu0) * 1e6 / n, (time.perf_counter() - wall0) * 1e6 / n


def med(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


# -- CPU and a redis-server's work ------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")
_SCRIPTS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def _stat(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        return handle.read().rsplit(")", 1)[1].split()  # [0] is field 3 (state)


def pid_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK


def group_cpu(pgid: int) -> float:
    """User + system CPU seconds of every live process of process group ``pgid`` (a Celery
    worker started in its own session: its main process and its pool)."""
    total = 0.0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = _stat(entry)
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def script_commands() -> frozenset[str]:
    """Command names that the Lua scripts of taskonce's Redis store call (``redis.call``)."""
    import taskonce.stores

    names: set[str] = set()
    for folder in map(Path, taskonce.stores.__path__):
        for path in [*folder.rglob("*.lua"), *folder.rglob("redis*.py")]:
            text = path.read_text(encoding="utf-8")
            names.update(re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", text))
    return frozenset(name.lower() for name in names)


@dataclasses.dataclass(frozen=True)
class StoreWork:
    """What a redis-server did between two readings."""

    cpu_s: float  # its process's user + system CPU seconds
    usec: int  # top-level commands' usec (a script's includes the commands it ran)
    commands: int  # commands as Redis counts them (those scripts ran included)
    scripts: int  # EVAL/EVALSHA/FCALL calls
    #: per command: (calls, usec); a command a script ran has its usec inside the script's
    by_command: dict[str, tuple[int, int]]

    def names(self, per: int) -> str:
        """``HDEL 1, HMGET 2, …`` per ``per`` calls: the commands run, scripts left out."""
        inner = {c: n for c, (n, _) in self.by_command.items() if c not in _SCRIPTS}
        return ", ".join(f"{c.upper()} {n / per:g}" for c, n in sorted(inner.items()))


class StoreMeter:
    """A redis-server's CPU (``/proc``) and its commands' time by ``INFO commandstats``. Redis
    counts a command a Lua script runs under its own name *and* in the script's usec;
    :meth:`since` counts it once, in the script's, where scripts ran."""

    def __init__(self, client: Any, pid: int) -> None:
        self.client, self.pid = client, pid
        self.nested = script_commands()

    def read(self) -> tuple[float, dict[str, tuple[int, int]]]:
        stats = {
            name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in self.client.info("commandstats").items()
        }
        return pid_cpu(self.pid), stats

    def since(self, before: tuple[float, dict[str, tuple[int, int]]]) -> StoreWork:
        cpu, after = self.read()
        delta = {
            c: (n - before[1].get(c, (0, 0))[0], u - before[1].get(c, (0, 0))[1])
            for c, (n, u) in after.items()
            if c not in ("info", "config|resetstat")
        }
        delta = {c: nu for c, nu in delta.items() if nu[0]}
        scripts = sum(delta.get(c, (0, 0))[0] for c in _SCRIPTS)
        own = {
            c: (n, 0 if scripts and c in self.nested and c not in _SCRIPTS else u)
            for c, (n, u) in delta.items()
        }
        return StoreWork(
            cpu - before[0],
            sum(u for _, u in own.values()),
            sum(n for n, _ in own.values()),
            scripts,
            own,
        )


# -- the docs ---------------------------------------------------------------------------------


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def command_line(script: str, argv: Sequence[str] | None = None) -> str:
    """The command as the docs quote it: ``.venv/bin/python bench/x.py --option …``."""
    args = list(sys.argv[1:] if argv is None else argv)
    runner = ["-m", script] if "/" not in script else [script]
    return shlex.join([".venv/bin/python", *runner, *args])


def measured_line(command: str, load_start: str, versions: Iterable[str] = ()) -> str:
    """The block's closing line: when, on what, the load, and the command that measured it."""
    when = datetime.datetime.now(datetime.timezone.utc)
    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"nproc {os.cpu_count()} ({cpu})", f"Python {platform.python_version()}", *versions]
    return (
        f"Measured {when:%Y-%m-%d %H:%M} UTC on {', '.join(parts)}; load average (1/5/15 min) "
        f"{load_start} at the start, {loadavg()} at the end; `{command}`."
    )


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column, ``r`` for right-aligned."""
    rules = ["---:" if a == "r" else "---" for a in align.ljust(len(header), "l")]
    lines = [header, rules, *([str(cell) for cell in row] for row in rows)]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def write_block(name: str, text: str, doc: Path = PERFORMANCE) -> None:
    """Replace what stands between ``<!-- bench:name -->`` and ``<!-- /bench:name -->`` in
    ``doc`` (read just before, replaced atomically: other benchmarks own other blocks)."""
    body = doc.read_text(encoding="utf-8")
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if body.count(start) != 1 or body.count(end) != 1:
        raise SystemExit(f"{doc.name} has no block {start} … {end}: nothing written")
    head, rest = body.split(start)
    tail = rest.split(end)[1]
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{head}{start}\n\n{text.strip()}\n\n{end}{tail}", encoding="utf-8")
    os.replace(tmp, doc)
    print(f"wrote the block {name!r} of {doc.relative_to(ROOT)}")
