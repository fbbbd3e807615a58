"""A fake payments API for the tests: a tiny threaded HTTP server on a free loopback port that
deduplicates charges by their ``Idempotency-Key`` header, as payment providers do.

``POST /charges`` with a JSON body ``{"order": …, "amount": …}``: a new key creates a charge
(``201``, ``{"id": "ch_…", …}``); a key seen before answers the first charge again (``200``,
the same id) without charging; the same key with another body is refused (``422``), and a
request without the header creates a charge every time (as a provider without idempotency
would). :attr:`PaymentsServer.charges` are the distinct charges made.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class PaymentsServer:
    """The server, started on ``127.0.0.1`` and a free port; ``url`` is its charges endpoint."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: distinct charges, in order: {"id", "order", "amount", "key"}
        self.charges: list[dict[str, Any]] = []
        #: every request: (idempotency key, status answered)
        self.requests: list[tuple[str | None, int]] = []
        self._by_key: dict[str, dict[str, Any]] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                status, answer = server.charge(self.headers.get("Idempotency-Key"), body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}/charges"

    def start(self) -> PaymentsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(10)

    def charge(self, key: str | None, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Deduplicate by ``key``: the first charge of a key again, or a new charge."""
        with self.lock:
            first = self._by_key.get(key) if key else None
            if first is not None:
                same = (first["order"], first["amount"]) == (body.get("order"), body.get("amount"))
                status = 200 if same else 422
                self.requests.append((key, status))
                if not same:
                    return status, {"error": "idempotency key reused with other parameters"}
                return status, first
            charge = {
                "id": f"ch_{uuid.uuid4().hex[:12]}",
                "order": body.get("order"),
                "amount": body.get("amount"),
                "key": key,
            }
            self.charges.append(charge)
            if key:
                self._by_key[key] = charge
            self.requests.append((key, 201))
            return 201, charge

    def __enter__(self) -> PaymentsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
