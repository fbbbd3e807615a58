"""Helpers of the metrics tests: a sink that raises, and scraping a multiprocess directory."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess, start_http_server


class RaisingSink:
    """A sink that fails on every event; the guard must log it and go on unchanged."""

    def emit(self, event: Mapping[str, Any]) -> None:
        raise RuntimeError(f"this sink is broken ({event['event']})")


class Scraper:
    """An HTTP ``/metrics`` endpoint over a ``PROMETHEUS_MULTIPROC_DIR``, as a Prometheus
    server would scrape it, and the values read back from the text."""

    def __init__(self, directory: Path) -> None:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(directory))
        # port 0: the system picks a free one, so no other test can take it in between
        self.server, self.thread = start_http_server(0, "127.0.0.1", registry=registry)
        self.port = int(self.server.server_address[1])

    def text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    def value(self, name: str, text: str | None = None, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        total = 0.0
        for line in (text if text is not None else self.text()).splitlines():
            match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
            if not match or match[1] != name:
                continue
            found = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match[2] or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match[3])
        return total

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
