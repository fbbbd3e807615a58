"""``taskonce inspect``/``stats`` show pending sends; ``taskonce relay`` publishes them."""

from __future__ import annotations

import io
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce import handoff
from taskonce.cli import main


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(list(argv), out=out)
    return code, out.getvalue()


def strand_sends(url: str) -> None:
    """A handled record whose two sends were never published (the broker was down)."""
    guard = taskonce.Guard(taskonce.open_store(url))

    def down(send: handoff.Send) -> None:
        raise ConnectionError("broker down")

    guard.register_publisher("celery", down)

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("celery", {"task": "shop.ship", "args": [1]}, message_id="child-1")
        capture.add("celery", {"task": "shop.mail", "args": [1]}, message_id="child-2")

    guard.run("m1", "orders", body)
    guard.close()


def test_inspect_and_stats_show_pending_sends(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    strand_sends(url)
    code, text = run("inspect", "orders:m1", "--store", url)
    assert code == 0
    assert re.search(r"^sends +2 pending$", text, re.M)
    assert "pending send child-1 celery shop.ship" in text
    assert text.index("child-1") < text.index("child-2")
    code, text = run("inspect", "orders:m1", "--store", url, "--json")
    data = json.loads(text)
    assert [s["id"] for s in data["sends"]] == ["child-1", "child-2"]
    assert data["sends"][0]["body"] == {"task": "shop.ship", "args": [1]}
    code, text = run("stats", "--store", url, "--json")
    assert json.loads(text)["sends_pending"] == 1


def test_relay_once_publishes_through_the_apps_publisher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    strand_sends(url)
    module = f"relayapp_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("app = object()\n")
    monkeypatch.chdir(tmp_path)
    published: list[str] = []
    seen: list[Any] = []

    def relay_guard(app: Any) -> taskonce.Guard:  # what the Celery adapter provides
        seen.append(app)
        guard = taskonce.Guard(taskonce.open_store(url))
        guard.register_publisher("celery", lambda send: published.append(send.id))
        return guard

    from taskonce import celery_ext

    monkeypatch.setattr(celery_ext, "relay_guard", relay_guard, raising=False)
    code, text = run("relay", "--celery-app", f"{module}:app", "--once", "--older-than", "0")
    assert (code, text) == (0, "published the pending sends of 1 record(s)\n")
    assert published == ["child-1", "child-2"]
    assert seen and type(seen[0]) is object
    code, text = run("relay", "--celery-app", f"{module}:app", "--once", "--json")
    assert json.loads(text) == {"dispatched": 0}


def test_relay_says_at_start_that_it_runs_until_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path}/cli.db"
    (tmp_path / "relayloop.py").write_text("app = object()\n")
    monkeypatch.chdir(tmp_path)
    sweeps: list[float] = []

    def relay_guard(app: Any) -> taskonce.Guard:
        guard = taskonce.Guard(taskonce.open_store(url))

        def relay(older_than: float, batch: int) -> int:
            sweeps.append(older_than)
            if len(sweeps) == 2:
                raise KeyboardInterrupt  # the user's Ctrl-C, in the second sweep
            return 0

        monkeypatch.setattr(guard, "relay", relay)
        return guard

    from taskonce import celery_ext

    monkeypatch.setattr(celery_ext, "relay_guard", relay_guard, raising=False)
    code, text = run("relay", "--celery-app", "relayloop:app", "--every", "0.01")
    assert (code, text, len(sweeps)) == (0, "", 2)
    assert (
        f"taskonce relay: running every 0.01 s on SQLStore sqlite:///{tmp_path}/cli.db "
        "(table taskonce_keys); Ctrl-C stops it; --once for one sweep\n"
    ) in capsys.readouterr().err
    code, text = run("relay", "--celery-app", "relayloop:app", "--once")
    assert (code, text) == (0, "published the pending sends of 0 record(s)\n")
    assert "Ctrl-C" not in capsys.readouterr().err  # --once: one sweep, nothing to stop


def test_relay_errors_are_clear(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run("relay", "--once")[0] == 2
    assert "needs --celery-app MODULE:app or --dramatiq-broker MODULE:broker" in (
        capsys.readouterr().err
    )
    assert run("relay", "--dramatiq-broker", "nosuchmodule_x:broker")[0] == 2
    assert "cannot import 'nosuchmodule_x'" in capsys.readouterr().err
    assert run("relay", "--celery-app", "justamodule")[0] == 2
    assert "expected MODULE:OBJECT" in capsys.readouterr().err
