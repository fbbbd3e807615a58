"""Griffe extension of the documentation site (mkdocs.yml, the python handler's ``extensions``).

The docstrings are written in Sphinx's style, with cross-reference roles such as
``:func:`taskonce.open_store``` or ``:class:`~taskonce.Policy```. mkdocstrings does not know
Sphinx's roles and would show them as they are written; this extension turns each one into a
cross-reference of mkdocs-autorefs before the docstring is parsed, so the API reference shows a
link. The source keeps its Sphinx style (readable in the code, in ``help()`` and in an IDE).

A role's target is resolved the way Sphinx reads it:

* a full path (``taskonce.open_store``) is taken as it is written;
* a short name (``Policy``, ``Guard.run``, ``close``) in the scope of the object whose docstring
  holds it: its own members, its class's (inherited ones too), then its module's names and
  imports;
* a leading dot (``.errors.Rejected``) from the holding object's scope outward;
* ``~`` shows only the last component (``~taskonce.Policy`` reads ``Policy``), ``!`` never links,
  and ``title <target>`` shows the title.

A resolved target becomes an *optional* cross-reference (the kind mkdocstrings itself writes
for annotations): a link where the site renders that object, plain code text where it does not
(a private helper, an object of another library). A name that does not resolve is plain code
text. So a role never becomes a broken link, and ``mkdocs build --strict`` stays clean.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import suppress
from html import escape
from typing import Any

import griffe

#: A Sphinx cross-reference role of the Python domain, e.g. ``:meth:`~taskonce.Guard.begin```.
ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|attr|mod|exc|data|obj|const|type):`(?P<content>[^`]+)`"
)
#: ``title <target>``: a role with an explicit title.
TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


def _documented(root: griffe.Object) -> Iterator[griffe.Object]:
    """``root`` and every object defined under it (not aliases: those are documented where
    their target is defined)."""
    yield root
    for member in list(root.members.values()):
        if not member.is_alias:
            yield from _documented(member)  # type: ignore[arg-type]


def _exists(collection: griffe.ModulesCollection, path: str) -> bool:
    try:
        collection.get_member(path)
    except Exception:  # a missing member, an external module, an unresolvable alias
        return False
    return True


def _resolve_first(obj: griffe.Object, name: str) -> str | None:
    """The full path of ``name`` (one component) in ``obj``'s scope, or None: the members of
    ``obj`` and of its parents, inherited members of a class included, and the names of the
    enclosing classes themselves."""
    scope: griffe.Object | None = obj
    while scope is not None:
        if scope.name == name and not scope.is_module:
            return scope.path
        members: dict[str, Any] = scope.members
        if scope.is_class:
            with suppress(Exception):  # a base class that cannot be resolved: its own only
                members = scope.all_members  # inherited ones too
        member = members.get(name)
        if member is not None:
            return str(member.target_path if member.is_alias else member.path)
        scope = scope.parent
    return None


def resolve(obj: griffe.Object, target: str, collection: griffe.ModulesCollection) -> str | None:
    """The full path that ``target`` (a role's target, without ``~`` or ``!``) names in the
    scope of ``obj``, or None when it names nothing known."""
    target = target.removesuffix("()")
    if target.startswith("."):
        rest = target.lstrip(".")
        scope: griffe.Object | None = obj
        while scope is not None:
            if _exists(collection, f"{scope.path}.{rest}"):
                return f"{scope.path}.{rest}"
            scope = scope.parent
        return None
    first, _, rest = target.partition(".")
    if rest and _exists(collection, target):
        return target
    base = _resolve_first(obj, first)
    if base is not None:
        return f"{base}.{rest}" if rest else base
    if rest or _exists(collection, target):
        # A full path of another library (``sqlalchemy.orm.Session``) is taken as written.
        return target
    return None


def convert(obj: griffe.Object, text: str, collection: griffe.ModulesCollection) -> str:
    """``text`` (a docstring of ``obj``) with each Sphinx role turned into Markdown: an optional
    autorefs cross-reference, or code text where the target does not resolve."""

    def replace(match: re.Match[str]) -> str:
        content = match["content"].strip()
        titled = TITLED.match(content)
        if titled:
            title, target = titled["title"], titled["target"].strip()
        else:
            title, target = "", content
        no_link = target.startswith("!")
        target = target.lstrip("!")
        short = target.startswith("~")
        target = target.lstrip("~")
        if not title:
            title = target.lstrip(".")
            if short:
                title = title.rsplit(".", 1)[-1]
        code = f"`{title}`"
        path = None if no_link else resolve(obj, target, collection)
        if path is None:
            return code
        return f'<autoref identifier="{escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Turn the Sphinx roles of a loaded package's docstrings into cross-references."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **_: Any) -> None:
        for obj in _documented(pkg):
            if obj.docstring is not None and ROLE.search(obj.docstring.value):
                obj.docstring.value = convert(obj, obj.docstring.value, loader.modules_collection)
