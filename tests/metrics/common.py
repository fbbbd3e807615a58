"""Helpers of the metrics tests: a sink that raises, and scraping a multiprocess directory."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, multiprocess, start_http_server

from tests.helpers import wait_for


class RaisingSink:
    """A sink that fails on every event; the guard must log it and go on unchanged."""

    def emit(self, event: Mapping[str, Any]) -> None:
        raise RuntimeError(f"this sink is broken ({event['event']})")


class Scraper:
    """A ``/metrics`` endpoint, scraped over HTTP as a Prometheus server would, and the values
    read back from the text. By default an endpoint in this process over a
    ``PROMETHEUS_MULTIPROC_DIR``; :meth:`at` points one at another process's endpoint."""

    def __init__(self, directory: Path | None = None) -> None:
        self.server: Any = None
        self.url = ""
        if directory is not None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=str(directory))
            # port 0: the system picks a free one, so no other test can take it in between
            self.server, _ = start_http_server(0, "127.0.0.1", registry=registry)
            self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    @classmethod
    def at(cls, url: str) -> Scraper:
        scraper = cls()
        scraper.url = url
        return scraper

    def text(self) -> str:
        """The scraped text. A scrape that meets a metrics file a worker process is creating at
        that moment fails (HTTP 500: prometheus-client reads the file before its header is
        written); Prometheus would try again at its next interval, and so does this."""

        def scrape() -> str | None:
            try:
                with urllib.request.urlopen(self.url, timeout=10) as reply:
                    return str(reply.read().decode())
            except urllib.error.HTTPError as exc:
                if exc.code == 500:
                    return None
                raise

        return str(wait_for(scrape, timeout=30, interval=0.1, what=f"a scrape of {self.url}"))

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
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
