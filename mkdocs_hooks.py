"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks``).

Pages are written for GitHub first: a page that only points at a file of the repository's top
level carries ``<!-- include: CHANGELOG.md -->`` and becomes that file on the site, and links to
top-level files go up out of ``docs/``. On the site those files are pages of their own, so the
included text's ``docs/…`` links and the pages' ``../CONTRIBUTING.md`` links are rewritten to
the site's pages. A ``python no-run`` block (compiled, not run, by the tests) is shown as
Python.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
#: ``python no-run`` marks a block the tests only compile; on the site it is plain Python.
NO_RUN = re.compile(r"^(?P<fence> {0,3}(?:`{3,}|~{3,}))python no-run[ \t]*$", re.MULTILINE)
INCLUDE = re.compile(r"<!-- include: (?P<name>[A-Za-z0-9_.-]+\.md) -->")
#: Top-level files that are pages of the site, and the page each one is.
TOP_LEVEL_PAGES = {"CHANGELOG.md": "changelog.md", "CONTRIBUTING.md": "contributing.md"}


def _included(name: str) -> str:
    text = (ROOT / name).read_text(encoding="utf-8")
    text = re.sub(r"\]\(docs/", "](", text)
    for top, page in TOP_LEVEL_PAGES.items():
        text = text.replace(f"]({top}", f"]({page}")
    return text


def on_page_markdown(markdown: str, **_: Any) -> str:
    include = INCLUDE.search(markdown)
    if include:
        return _included(include["name"])
    for name, page in TOP_LEVEL_PAGES.items():
        markdown = markdown.replace(f"](../{name}", f"]({page}")
    return NO_RUN.sub(r"\g<fence>python", markdown)
