"""``make install`` (and ``make demo``, which runs it first) is quiet: setuptools warns about a
folder of the package that holds files but is not listed in ``packages`` (the Django admin's
templates once), so every such folder is listed; and the editable install's note is filtered
by the Makefile."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_folder_with_files_is_a_listed_package() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapped = setuptools["package-dir"]
    found: set[str] = set()
    for name, folder in mapped.items():
        for path in (ROOT / folder).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            parts = path.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *parts]))
    missing = sorted(found - listed)
    assert not missing, f"folders with files that pyproject's packages lacks: {missing}"
    for package, globs in setuptools["package-data"].items():
        assert package in listed, package
        assert all("/" not in glob for glob in globs), (package, globs)  # data in its package


def test_the_install_filters_setuptools_editable_note() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert (
        'PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(PY) -m pip install '
        "--quiet -e '.[all,sqs,dev]'"
    ) in makefile
