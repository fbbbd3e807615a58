"""The documentation is tested like code.

Links: every relative link and image in every Markdown file of the repository (README, docs/,
CONTRIBUTING, CHANGELOG, …) points at a file inside the repository, and a ``#fragment`` at a
heading of that file (GitHub's heading anchors). No file names the team's private design
notes: everything a user needs is in docs/.

Snippets: every fenced block in README.md and docs/ (every page of the site, subfolders too)
whose info string is exactly ``python`` runs, **each as its own Python program** (a fresh
interpreter, nothing shared with the other blocks) in a fresh temporary working directory, so
relative paths such as ``sqlite:///taskonce.db`` or ``events.jsonl`` land there and vanish. A block must succeed (exit
status 0) within ``SNIPPET_TIMEOUT`` seconds. Snippets may use ``memory://``, SQLite in the
working directory, or the local services (Redis db 15, PostgreSQL ``test``) with names of their
own, and must clean up what they create there. Any other info string starting with ``python``
than ``python`` and ``python no-run`` is an error, so a typo cannot silently skip a block.
Shell commands use ``sh``, output ``text`` (not checked here).

No-run blocks: a block that needs something this test cannot provide (a running worker, the
user's own app module or project, a cluster) uses the info string ``python no-run``. It is
compiled, and **the suite must run its lines**: the line right before its opening fence is an
HTML comment naming the file(s) of the suite that do (invisible on GitHub and on the site)::

    <!-- tested in: tests/django_project/celery.py, tests/django_project/shop/docs_tasks.py -->

The files are Python files under ``tests/`` that the suite runs (a test module, or a module or
script a test imports or starts). The block's lines must be the files' lines, by this rule
(:func:`code_lines`, :func:`first_line_not_in`):

- Both sides are cut into physical lines; from each, a comment (``#`` to the end of the line,
  found by Python's tokenizer, so a ``#`` inside a string stays) is removed, then the
  surrounding white space (indentation does not count: a block's top-level lines may sit in a
  test function).
- Lines left empty (blank lines, comment-only lines) do not count, and neither does a line
  holding the placeholder ``...`` (the Ellipsis token: ``...`` alone, ``Order(...)``,
  ``[..., "app"]``, ``def f(): ...``) — the reader fills those in.
- Every other line of the block must equal a line of the files, taken in the order the marker
  names them as one text, **in the block's order**; the files may have more lines before,
  between and after (imports, a fixture, the test's assertions).

A block that a test reads from its page and runs as written (in a project the test lays out)
says so instead: ``<!-- run from the page by: tests/django/test_layout.py -->``; that file must
name the page and the block's first line (how it finds the block).

A no-run block without the marker, or whose line is missing, fails with what to add. So a
snippet and the code that proves it cannot drift apart: change one, and this test says which
line the other lacks. CONTRIBUTING.md repeats this convention for writers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
import unicodedata
from functools import cache
from pathlib import Path
from types import ModuleType
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {
    ".git", ".venv", "build", "dist", "site", "node_modules", ".pytest_cache", ".mypy_cache",
}  # fmt: skip
# A Spark snippet starts a JVM and runs an audit: about 100 s on a loaded 2-CPU machine.
SNIPPET_TIMEOUT = 240.0
#: Built from parts so this file does not name them itself.
FORBIDDEN = ("DESIGN" + ".md", "shared" + "/")

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n]*)$")
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)"
)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>\S+?)>?(?:\s+.*)?$")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(?P<text>.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"(?P<name>[^\"]+)\"")


def markdown_files() -> list[Path]:
    found = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = set(path.relative_to(ROOT).parts[:-1])
        if parts & SKIP_DIRS or any(p.endswith(".egg-info") for p in parts):
            continue
        found.append(path)
    return found


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    info: str
    source: str
    before: str = ""  # the line right before the opening fence

    @property
    def id(self) -> str:
        return f"{shown(self.path)}:{self.line}"


def split(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """The lines outside fenced blocks (with their numbers) and the fenced blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence = opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence):
                if not closing["info"].strip():
                    break
            body.append(lines[j])
            j += 1
        before = lines[i - 1] if i else ""
        blocks.append(
            Block(Path(), i + 1, opening["info"].strip(), "\n".join(body) + "\n", before)
        )
        i = j + 1
    return prose, blocks


def blocks_of(path: Path) -> list[Block]:
    _, blocks = split(path.read_text(encoding="utf-8"))
    return [dataclasses.replace(b, path=path) for b in blocks]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup removed, lower case, punctuation dropped, spaces
    to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        for match in HTML_ANCHOR.finditer(line):
            found.add(match["name"])
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading["text"])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    prose, _ = split(path.read_text(encoding="utf-8"))
    found = []
    for number, line in prose:
        without_code = CODE_SPAN.sub("", line)
        for match in INLINE_LINK.finditer(without_code):
            found.append((number, match["target"]))
        definition = REFERENCE_DEF.match(without_code)
        if definition:
            found.append((number, definition["target"]))
    return found


def broken_link(path: Path, target: str) -> str | None:
    """Why ``target`` (a link in ``path``) is broken, or None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    if target.startswith("//"):
        return "protocol-relative links leave the repository"
    file_part, _, fragment = target.partition("#")
    if file_part.startswith("/"):
        return "absolute paths do not work in a clone or on the package page"
    destination = (path.parent / unquote(file_part)).resolve() if file_part else path
    if destination != ROOT and ROOT not in destination.parents:
        return "points outside the repository"
    if not destination.exists():
        return "no such file"
    if fragment:
        if destination.suffix != ".md" or destination.is_dir():
            return None  # line anchors of source files are GitHub's business
        if unquote(fragment) not in anchors(destination):
            return f"no heading with the anchor #{fragment} in {destination.relative_to(ROOT)}"
    return None


# -- links ---------------------------------------------------------------------------------


def test_there_is_documentation_to_check() -> None:
    names = {str(p.relative_to(ROOT)) for p in markdown_files()}
    assert {"README.md", "docs/how-it-works.md", "docs/core.md"} <= names


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = [
        f"{path.relative_to(ROOT)}:{number}: {target}: {reason}"
        for number, target in links(path)
        if (reason := broken_link(path, target))
    ]
    assert not problems, "\n".join(problems)


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    found = []
    for name in filter(None, listed.split("\0")):
        path = ROOT / name
        if path.is_file() and path.suffix not in {".png", ".jpg", ".gz", ".parquet", ".jar"}:
            found.append(path)
    return found


def test_no_file_names_the_private_design_notes() -> None:
    offenders = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if any(word in line for word in FORBIDDEN):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_link_checker_catches_what_it_must(tmp_path: Path) -> None:
    """The checker itself: a missing file, an escape from the repository, a missing anchor."""
    page = ROOT / "docs" / "how-it-works.md"
    assert broken_link(page, "core.md") is None
    assert broken_link(page, "core.md#stores") is None
    assert broken_link(page, "#events") is None
    assert broken_link(page, "https://example.org/x") is None
    assert broken_link(page, "nowhere.md") == "no such file"
    assert broken_link(page, "../../elsewhere/notes.md") == "points outside the repository"
    assert "#no-such-heading" in (broken_link(page, "core.md#no-such-heading") or "")
    assert slug("What it writes (`--out DIR`, replaced on each run)") == (
        "what-it-writes---out-dir-replaced-on-each-run"
    )
    fake = tmp_path / "x.md"
    fake.write_text("see [a](a.md) and `[b](b.md)`\n\n```sh\n[c](c.md)\n```\n[d]: d.md\n")
    assert [target for _, target in links(fake)] == ["a.md", "d.md"]


# -- snippets --------------------------------------------------------------------------------


def snippet_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks() -> list[Block]:
    return [b for page in snippet_pages() for b in blocks_of(page) if b.info.startswith("python")]


def test_python_blocks_use_a_known_info_string() -> None:
    unknown = [
        f"{b.id}: {b.info!r}" for b in python_blocks() if b.info not in ("python", "python no-run")
    ]
    assert not unknown, "use ```python or ```python no-run:\n" + "\n".join(unknown)


#: The line right before a ``python no-run`` block's fence: the suite files that run its lines.
TESTED_IN = re.compile(r"^<!-- tested in: (?P<files>[^<>]+?) -->$")
#: A block a test reads from its page and runs as written (e.g. in a project it lays out).
RUN_FROM_PAGE = re.compile(r"^<!-- run from the page by: (?P<file>[^<>,]+?) -->$")


def code_lines(source: str, name: str) -> list[tuple[int, str]]:
    """The lines of Python ``source`` that count when a no-run block is compared with the suite:
    each physical line with its comment cut off and stripped, without the blank ones and those
    holding the placeholder ``...`` (the Ellipsis token, not ``...`` inside a string), each
    with its 1-based number. ``name`` says where ``source`` comes from, for the error."""
    comment_at: dict[int, int] = {}
    placeholders: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                comment_at[token.start[0]] = token.start[1]
            elif token.type == tokenize.OP and token.string == "...":
                placeholders.add(token.start[0])
    except (tokenize.TokenError, SyntaxError) as exc:
        raise ValueError(f"{name} is not Python that tokenizes: {exc}") from exc
    kept = []
    for number, line in enumerate(source.splitlines(), 1):
        text = line[: comment_at.get(number, len(line))].strip()
        if text and number not in placeholders:
            kept.append((number, text))
    return kept


def suite_files(block: Block) -> list[Path]:
    """The files named by the block's ``<!-- tested in: … -->`` marker (``[]``: none)."""
    marker = TESTED_IN.match(block.before.strip())
    if not marker:
        return []
    return [ROOT / name.strip() for name in marker["files"].split(",") if name.strip()]


def shown(path: Path) -> str:
    """``path`` as the messages name it: relative to the repository when inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def first_line_not_in(block: Block, files: list[Path]) -> str | None:
    """Why the block's lines are not the files' (the first one missing), or None: every line of
    :func:`code_lines` of the block equals one of the files' (taken in the order named, as one
    text), in the same order; the files may have more lines before, between and after."""
    have = [
        text
        for path in files
        for _, text in code_lines(path.read_text(encoding="utf-8"), shown(path))
    ]
    position = 0
    for number, text in code_lines(block.source, block.id):
        while position < len(have) and have[position] != text:
            position += 1
        if position == len(have):
            names = ", ".join(shown(p) for p in files)
            return (
                f"{shown(block.path)}:{block.line + number}: `{text}` is not in {names} "
                "(after the lines of the block before it)"
            )
        position += 1
    return None


NO_RUN_HELP = (
    "a ```python no-run block is not run by the tests, so the suite must run the same lines: "
    "put `<!-- tested in: tests/FILE.py -->` on the line right before its fence, naming the "
    "file(s) of the suite that use them (several: comma-separated, in the block's order), or "
    "make it a ```python block that runs as it is"
)


@pytest.mark.parametrize(
    "block", [b for b in python_blocks() if b.info == "python no-run"], ids=lambda b: b.id
)
def test_no_run_snippet_is_the_suites_code(block: Block) -> None:
    """A block that cannot run here (it needs a worker, the user's app) compiles, and its lines
    are those of suite files that do run: see :func:`code_lines` and :func:`first_line_not_in`."""
    compile(block.source, block.id, "exec")
    run_by = RUN_FROM_PAGE.match(block.before.strip())
    if run_by:
        # The test finds the block by the page's name and the block's first line, and runs it.
        test = ROOT / run_by["file"].strip()
        assert test.is_file() and test.is_relative_to(ROOT / "tests"), f"{block.id}: {test}"
        first = block.source.splitlines()[0].strip()
        text = test.read_text(encoding="utf-8")
        page = block.id.split(":")[0].rsplit("/", 1)[-1]
        assert page in text and repr(first)[1:-1] in text, (
            f"{block.id}: {run_by['file']} does not read this block (by {page!r} and {first!r})"
        )
        return
    files = suite_files(block)
    assert files, f"{block.id}: {NO_RUN_HELP}"
    for path in files:
        assert path.is_file(), f"{block.id}: tested in {path.relative_to(ROOT)}: no such file"
        assert path.suffix == ".py" and path.is_relative_to(ROOT / "tests"), (
            f"{block.id}: tested in {path.relative_to(ROOT)}: name a Python file under tests/"
        )
    problem = first_line_not_in(block, files)
    assert problem is None, problem


def test_only_no_run_blocks_carry_the_marker() -> None:
    """A ``tested in`` marker before a block that runs (or is not Python) is a leftover: the
    block is not compared with the files it names."""
    stray = [
        f"{b.id}: {b.info!r}"
        for page in snippet_pages()
        for b in blocks_of(page)
        if suite_files(b) and b.info != "python no-run"
    ]
    assert not stray, "remove the <!-- tested in: … --> line before:\n" + "\n".join(stray)


def test_no_run_checker_catches_what_it_must(tmp_path: Path) -> None:
    """The rule itself: comments, blank lines, placeholder lines and indentation do not count;
    every other line must be in the files, in the block's order, other lines between."""
    assert code_lines("a = 1  # one\n\n  # only\nf(...)\n...\nb = '...'  # '#'\n", "x") == [
        (1, "a = 1"),
        (6, "b = '...'"),
    ]
    with pytest.raises(ValueError, match="not Python that tokenizes"):
        code_lines("f(\n", "broken.md")
    first = tmp_path / "first.py"
    first.write_text("import os\n\ndef setup():\n    app = make(  # the real one\n        1)\n")
    second = tmp_path / "second.py"
    second.write_text("log()\nrun(app)\n")

    def block(source: str, before: str = "") -> Block:
        return Block(tmp_path / "page.md", 10, "python no-run", source, before)

    same = "# app.py\napp = make(   # comment\n    ...,\n1)\n\nrun(app)   # then\n"
    assert first_line_not_in(block(same), [first, second]) is None
    assert first_line_not_in(block("import os\n"), [first, second]) is None
    swapped = first_line_not_in(block("run(app)\napp = make(\n1)\n"), [first, second])
    assert swapped == (
        f"{tmp_path / 'page.md'}:12: `app = make(` is not in {first}, {second} "
        "(after the lines of the block before it)"
    )
    assert first_line_not_in(block("run(app)\n"), [second, first]) is None
    assert "`run(app, 2)`" in (first_line_not_in(block("run(app, 2)\n"), [second]) or "")
    assert suite_files(block("x\n", "<!-- tested in: tests/a.py, tests/b.py -->")) == [
        ROOT / "tests" / "a.py",
        ROOT / "tests" / "b.py",
    ]
    assert suite_files(block("x\n", "<!-- tested: tests/a.py -->")) == []
    assert suite_files(block("x\n", "")) == []


@pytest.mark.parametrize(
    "block", [b for b in python_blocks() if b.info == "python"], ids=lambda b: b.id
)
def test_snippet_runs(block: Block, tmp_path: Path) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", block.source], cwd=tmp_path, capture_output=True,
            text=True, timeout=SNIPPET_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id}: still running after {SNIPPET_TIMEOUT}s\n{exc.stderr!r}")
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"


# -- the site's API reference ---------------------------------------------------------------

#: A Sphinx role left as it is written (``:func:`x``` shows as ``:func:<code>x</code>``).
RAW_ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|attr|mod|exc|data|obj):(?:`|<code>|\\u003ccode|&lt;code)"
)
PACKAGE_FOLDERS = ("celery_ext", "dramatiq_ext", "spark_ext", "demo", "django_ext")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as the Makefile's docs target builds it, in a temporary tree (links to
    the repository's files, the link tree of the code under its import names), so the test
    touches neither site/ nor build/."""
    pytest.importorskip("mkdocstrings_handlers.python")
    tree = tmp_path_factory.mktemp("docs-build")
    for entry in ROOT.iterdir():
        if entry.name not in {"site", "build", ".git", ".venv", "mkdocs.yml"}:
            (tree / entry.name).symlink_to(entry)
    shutil.copy(ROOT / "mkdocs.yml", tree / "mkdocs.yml")  # its paths are relative to it
    code = tree / "build" / "docs-src" / "taskonce"
    code.mkdir(parents=True)
    for path in sorted((ROOT / "core").iterdir()):
        (code / path.name).symlink_to(path)
    for folder in PACKAGE_FOLDERS:
        (code / folder).symlink_to(ROOT / folder)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"], cwd=tree,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return tree / "site"


def test_the_site_shows_no_raw_sphinx_role(built_site: Path) -> None:
    """The docstrings' Sphinx roles (``:func:`…```) are rendered, not shown as written: on no
    page, and not in the search index."""
    offenders = []
    for path in sorted(built_site.rglob("*")):
        if path.suffix not in {".html", ".json", ".xml", ".txt"}:
            continue
        text = path.read_text(encoding="utf-8")
        for match in RAW_ROLE.finditer(text):
            context = text[max(0, match.start() - 60) : match.end() + 60].replace("\n", " ")
            offenders.append(f"{path.relative_to(built_site)}: …{context}…")
    assert not offenders, "\n".join(offenders[:20]) + f"\n({len(offenders)} in all)"


def test_the_api_reference_links_its_cross_references(built_site: Path) -> None:
    """A role becomes a link to the object's entry (a full path, a short name resolved where
    the docstring is, ``~`` showing the last component); a role whose target the site does not
    render is code text, not a broken link."""
    page = (built_site / "reference" / "index.html").read_text(encoding="utf-8")

    def link(anchor: str, text: str) -> re.Pattern[str]:
        return re.compile(
            rf'<a class="autorefs autorefs-internal"[^>]* href="#{re.escape(anchor)}">'
            rf"<code>{re.escape(text)}</code></a>"
        )

    assert link("taskonce.open_store", "taskonce.open_store").search(page)  # :func:`taskonce.…`
    assert link("taskonce.Policy", "Policy").search(page)  # :class:`Policy` in Guard
    assert link("taskonce.Guard.begin", "Guard.begin").search(page)  # :meth:`Guard.begin`
    assert link("taskonce.JsonlEvents", "JsonlEvents").search(page)  # :class:`~taskonce.…`
    assert link("taskonce.errors.LeaseLost", "LeaseLost").search(page)  # from taskonce.stores
    # A private helper (not rendered) and another library's class: code text.
    assert re.search(r'<span title="[^"]*\._decide"><code>_decide</code></span>', page)
    assert "<code>sqlalchemy.orm.Session</code>" not in page  # ~ shows the last component
    assert re.search(r"<code>Session</code>", page)
    assert "<autoref" not in page


def _roles_extension() -> ModuleType:
    path = ROOT / "griffe_sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("griffe_sphinx_roles", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roles_resolve_in_the_scope_of_their_docstring(tmp_path: Path) -> None:
    """The Griffe extension (griffe_sphinx_roles.py) on a small package: each form of role."""
    griffe = pytest.importorskip("griffe")
    roles = _roles_extension()
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""Top: :func:`pkg.mod.helper`, :class:`~pkg.mod.Thing`, :mod:`nowhere`."""\n'
        "from pkg.mod import Thing\n"
    )
    (package / "mod.py").write_text(
        "from collections import OrderedDict\n\n"
        "class Base:\n"
        "    def close(self):\n"
        '        """Close."""\n\n'
        "class Thing(Base):\n"
        '    """:meth:`close` :meth:`Thing.run` :class:`OrderedDict` :class:`!Thing`\n\n'
        '    :func:`run it <helper>` :class:`Missing` :func:`~.mod.helper` :obj:`os.sep`."""\n\n'
        "    def run(self):\n"
        '        """Calls :func:`helper` and :meth:`run`."""\n\n'
        "def helper():\n"
        '    """Helps :class:`Thing`."""\n'
    )
    loaded = griffe.load(
        "pkg", search_paths=[tmp_path], extensions=griffe.load_extensions(roles.SphinxRoles())
    )

    def ref(path: str, text: str) -> str:
        return f'<autoref identifier="{path}" optional>`{text}`</autoref>'

    assert loaded.docstring.value == (
        f"Top: {ref('pkg.mod.helper', 'pkg.mod.helper')}, {ref('pkg.mod.Thing', 'Thing')}, "
        "`nowhere`."
    )
    thing = loaded["mod.Thing"]
    assert thing.docstring.value == (
        f"{ref('pkg.mod.Base.close', 'close')} {ref('pkg.mod.Thing.run', 'Thing.run')} "
        f"{ref('collections.OrderedDict', 'OrderedDict')} `Thing`\n\n"
        f"{ref('pkg.mod.helper', 'run it')} `Missing` {ref('pkg.mod.helper', 'helper')} "
        f"{ref('os.sep', 'os.sep')}."
    )
    assert thing["run"].docstring.value == (
        f"Calls {ref('pkg.mod.helper', 'helper')} and {ref('pkg.mod.Thing.run', 'run')}."
    )
    assert loaded["mod.helper"].docstring.value == f"Helps {ref('pkg.mod.Thing', 'Thing')}."


# -- licence -------------------------------------------------------------------------------


def test_the_licence_is_declared_and_shipped() -> None:
    """pyproject declares an SPDX licence with its file (no setuptools deprecation warning), and
    the file is the Apache License 2.0 in full."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
