"""Running from a source checkout: `python -m pyddp...` or `python -m pytest` in
the clone's root puts the source folder first on sys.path, and that folder has
no compiled `_C` after a plain `pip install .`. pyddp then loads every module
but this one and `__init__` from the installed build, and says so if the two
differ (an install older than the source being edited)."""

from __future__ import annotations

import filecmp
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from typing import List

# The README's development install ("Build from source"; its build
# requirements come first, as there).
DEVELOP = (
    "`pip install scikit-build-core pybind11 cmake ninja` then "
    '`pip install --no-build-isolation -e .` (README, "Build from source")'
)


def _has_extension(folder: str) -> bool:
    """An extension module this interpreter can load (not a .pyi stub, not
    another Python version's build)."""
    return any(
        os.path.exists(os.path.join(folder, "_C" + suffix))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )


def _installed_copy(source: str) -> str:
    """The first pyddp on sys.path, other than `source`, that holds `_C`."""
    for entry in sys.path:
        folder = os.path.join(entry or os.getcwd(), "pyddp")
        if (
            os.path.realpath(folder) != os.path.realpath(source)
            and _has_extension(folder)
            and os.path.exists(os.path.join(folder, "__init__.py"))
        ):
            return folder
    return ""


def _differing(source: str, installed: str) -> List[str]:
    names = []
    for root, _, files in os.walk(source):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, source)
            other = os.path.join(installed, rel)
            if not os.path.exists(other) or not filecmp.cmp(path, other, shallow=False):
                names.append(rel)
    return sorted(names)


def use_installed_build(path: List[str]) -> List[str]:
    """The package's search path: `path` itself when it holds the compiled
    extension, else the installed build's folder. Raises ImportError naming the
    fix when there is no build at all."""
    source = path[0]
    # In the folder itself (an in-place build), or mapped there by an editable
    # install's import hook.
    if _has_extension(source) or importlib.util.find_spec("pyddp._C") is not None:
        return path
    installed = _installed_copy(source)
    if not installed:
        raise ImportError(
            f"pyddp's compiled extension (_C) is not in {source} and no installed pyddp "
            "was found: run `pip install .` from the repository root (or, to develop in "
            f"place, {DEVELOP})"
        )
    changed = _differing(source, installed)
    if changed:
        shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
        warnings.warn(
            f"pyddp: running the installed build in {installed}, not the source folder "
            f"{source}, which differs from it ({shown}); run `pip install .` again to use "
            f"your changes, or, to develop in place, {DEVELOP}",
            stacklevel=3,
        )
    return [installed]
