"""Shared fixtures: one fixture per store kind (see tests/helpers.py for the services)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from taskonce.stores import Store
from tests.helpers import STORE_KINDS, drop_store, make_store


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)
