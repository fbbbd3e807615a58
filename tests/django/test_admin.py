"""The read-only admin of the store's records, through Django's test client on the test
project's PostgreSQL database: the list, its filters and search, nothing to add, change or
delete, and the release action with its confirmation page."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.django.ops_fixtures import (
    CLAIMED,
    EXPIRED,
    HANDLED,
    KEYS,
    OTHER,
    SENDING,
    project_store,
    put_records,
)

LIST = "/admin/taskonce/record/"


@pytest.fixture
def store() -> Iterator[Any]:
    yield from project_store()


@pytest.fixture
def users(store: Any) -> Iterator[dict[str, Any]]:
    """An admin (superuser) and a viewer (staff, ``view_record`` only)."""
    from django.contrib.auth.models import Permission, User

    admin = User.objects.create_superuser("djops-admin", "admin@example.com", "x")
    viewer = User.objects.create_user("djops-viewer", "viewer@example.com", "x", is_staff=True)
    viewer.user_permissions.add(
        Permission.objects.get(content_type__app_label="taskonce", codename="view_record"),
        Permission.objects.get(content_type__app_label="taskonce", codename="view_workerseen"),
    )
    try:
        yield {"admin": admin, "viewer": viewer}
    finally:
        User.objects.filter(pk__in=[admin.pk, viewer.pk]).delete()


def client(user: Any) -> Any:
    from django.test import Client

    c = Client()
    c.force_login(user)
    return c


def listed(response: Any) -> list[str]:
    """The keys in the list's key column."""
    assert response.status_code == 200, response.status_code
    html = response.content.decode()
    return sorted(re.findall(r'<th class="field-key"><a href="[^"]*">([^<]+)</a></th>', html))


def test_the_list_shows_every_record_with_queue_state_and_dates(
    store: Any, users: dict[str, Any]
) -> None:
    put_records(store)
    response = client(users["admin"]).get(LIST)
    assert listed(response) == sorted(KEYS)
    html = response.content.decode()
    for state in ("in progress", "handled", "sends pending", "expired"):
        assert f'<td class="field-state">{state}</td>' in html
    assert '<td class="field-queue">payments</td>' in html
    assert '<td class="field-worker_name">host:1:0</td>' in html
    record = store.get(CLAIMED)
    assert str(record.created_at) not in html  # a date, not seconds since the epoch
    assert time.strftime("%Y") in re.search(r'<td class="field-created[^>]*>([^<]+)<', html)[1]
    assert "Add record" not in html and "/admin/taskonce/record/add/" not in html


def test_filters_by_queue_and_state_and_search_by_key(store: Any, users: dict[str, Any]) -> None:
    from django.test.utils import override_settings

    put_records(store)
    c = client(users["admin"])
    queues = {"STORE": "django://default", "QUEUES": {"refunds": {"mode": "lazy"}}}
    with override_settings(TASKONCE=queues):
        html = c.get(LIST).content.decode()
    offered = re.findall(r'href="\?queue=([^"&]+)"', html)
    assert offered == ["emails", "payments", "refunds", "reports"]  # settings + sample
    assert listed(c.get(LIST, {"queue": "payments"})) == sorted([CLAIMED, OTHER])
    assert listed(c.get(LIST, {"queue": "refunds"})) == []
    assert listed(c.get(LIST, {"state": "in_progress"})) == sorted([CLAIMED, OTHER])
    assert listed(c.get(LIST, {"state": "handled"})) == [HANDLED]
    assert listed(c.get(LIST, {"state": "sending"})) == [SENDING]
    assert listed(c.get(LIST, {"state": "expired"})) == [EXPIRED]
    assert listed(c.get(LIST, {"state": "handled", "queue": "emails"})) == [HANDLED]
    assert listed(c.get(LIST, {"q": "m-sending"})) == [SENDING]


def test_nothing_can_be_added_changed_or_deleted(store: Any, users: dict[str, Any]) -> None:
    from django.contrib.admin.utils import quote

    put_records(store)
    c = client(users["admin"])
    assert c.get(f"{LIST}add/").status_code == 403
    change = f"{LIST}{quote(HANDLED)}/change/"
    response = c.get(change)
    assert response.status_code == 200
    html = response.content.decode()
    assert HANDLED in html and 'name="_save"' not in html
    assert c.post(change, {"key": "x", "status": "completed"}).status_code == 403
    assert c.get(f"{LIST}{quote(HANDLED)}/delete/").status_code == 403
    assert c.post(f"{LIST}{quote(HANDLED)}/delete/", {"post": "yes"}).status_code == 403
    actions = re.findall(r'<option value="([a-z_]+)"', c.get(LIST).content.decode())
    assert actions == ["release_selected"]  # no delete_selected
    assert store.get(HANDLED) is not None


def test_release_asks_first_then_releases_the_selected_records_only(
    store: Any, users: dict[str, Any]
) -> None:
    from taskonce.django_ext.models import Record

    put_records(store)
    c = client(users["admin"])
    chosen = {"action": "release_selected", "_selected_action": [CLAIMED, SENDING]}
    response = c.post(LIST, chosen)
    assert response.status_code == 200
    html = response.content.decode()
    assert "Release these 2 record(s)?" in html
    assert f"<li>{CLAIMED}</li>" in html and f"<li>{SENDING}</li>" in html
    assert HANDLED not in html
    assert 'name="post" value="yes"' in html and 'value="release_selected"' in html
    assert store.get(CLAIMED) is not None and store.get(SENDING) is not None  # not yet

    response = c.post(LIST, {**chosen, "post": "yes"}, follow=True)
    assert response.status_code == 200
    assert "Released 2 record(s)." in response.content.decode()
    assert store.get(CLAIMED) is None and store.get(SENDING) is None
    left = sorted(Record.objects.using("default").values_list("key", flat=True))
    assert left == sorted([HANDLED, OTHER, EXPIRED])


def test_a_quarantined_key_is_shown_filtered_and_re_armed_by_release(
    store: Any, users: dict[str, Any]
) -> None:
    put_records(store)
    key = "payments:m-crashing"
    store.claim(key, "w1", 300, 3600, None, "host:1:0")
    assert store.take_over(key, "w1", "w2", 300, 3600, "host:2:0") == 1
    store.quarantine(key, "w2", 3600)
    c = client(users["admin"])
    html = c.get(LIST).content.decode()
    assert '<td class="field-state">quarantined</td>' in html
    assert 'href="?state=quarantined"' in html
    assert listed(c.get(LIST, {"state": "quarantined"})) == [key]
    assert key not in listed(c.get(LIST, {"state": "handled"}))
    chosen = {"action": "release_selected", "_selected_action": [key], "post": "yes"}
    response = c.post(LIST, chosen, follow=True)
    assert "Released 1 record(s)." in response.content.decode()
    assert store.get(key) is None
    assert store.claim(key, "w3", 300, 3600, None, "host:3:0").crashes == 0  # runs again


def test_a_viewer_sees_the_records_but_cannot_release(store: Any, users: dict[str, Any]) -> None:
    put_records(store)
    c = client(users["viewer"])
    response = c.get(LIST)
    assert listed(response) == sorted(KEYS)
    assert "release_selected" not in response.content.decode()
    response = c.post(
        LIST, {"action": "release_selected", "_selected_action": [CLAIMED], "post": "yes"}
    )
    assert response.status_code in (200, 302)
    assert store.get(CLAIMED) is not None


def test_hidden_when_the_store_is_not_a_django_database(store: Any, users: dict[str, Any]) -> None:
    from django.test.utils import override_settings

    c = client(users["admin"])
    with override_settings(TASKONCE={"STORE": "memory://"}):
        assert c.get(LIST).status_code == 403
        assert "/admin/taskonce/" not in c.get("/admin/").content.decode()
    assert "/admin/taskonce/record/" in c.get("/admin/").content.decode()


def test_workers_seen(store: Any, users: dict[str, Any]) -> None:
    store.beat("host:9:0", 60.0)
    response = client(users["viewer"]).get("/admin/taskonce/workerseen/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "host:9:0" in html
    assert 'alt="True"' in html  # alive
    assert "/admin/taskonce/workerseen/add/" not in html


def test_receipt_markers_are_not_listed_and_workers_read_as_host_and_pid(
    store: Any, users: dict[str, Any]
) -> None:
    from taskonce.receipts import received_key

    put_records(store)
    worker = "web-7/4026531836/4242/12345678"  # host/ns/pid/start, as a guard writes it
    store.claim("payments:m-worker", "owner-3", 300.0, 3600.0, None, worker)
    assert store.mark(received_key("payments:m-worker"), 3600.0, None, None)  # bookkeeping
    c = client(users["admin"])
    response = c.get(LIST)
    assert listed(response) == sorted([*KEYS, "payments:m-worker"])  # no "…\x1freceived"
    html = response.content.decode()
    assert '<td class="field-worker_name">web-7 pid 4242</td>' in html
    assert listed(c.get(LIST, {"q": "web-7"})) == ["payments:m-worker"]  # found by its host
    assert listed(c.get(LIST, {"q": "received"})) == []
