"""Running from a clone's root: `python -m pyddp...` there imports the source
folder, which has no compiled `_C` after `pip install .`; pyddp must then run
the installed build (and say so when the two differ), or name the fix."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest


def source_copy(tmp_path: Path) -> Path:
    """A clone's root: the package's Python files without the compiled `_C`
    (taken from the installed build, so the two agree until edited)."""
    (tmp_path / "empty").mkdir()
    installed = run(tmp_path / "empty", "import os, pyddp; print(os.path.dirname(pyddp.__file__))")
    assert installed.returncode == 0, installed.stderr
    folder = Path(installed.stdout.strip())
    if not any((folder / f"_C{suffix}").exists() for suffix in EXTENSION_SUFFIXES):
        # `pip install -e .` (README, "Build from source"): `import pyddp` is
        # the clone itself wherever it runs, so there is no source folder
        # shadowing an installed build; CI checks this with `pip install .`.
        pytest.skip("an editable install imports the clone itself: no fallback to check")
    shutil.copytree(
        installed.stdout.strip(),
        tmp_path / "pyddp",
        ignore=shutil.ignore_patterns(*(f"_C{s}" for s in EXTENSION_SUFFIXES), "__pycache__"),
    )
    return tmp_path


def run(cwd: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_a_source_folder_without_the_extension_runs_the_installed_build(tmp_path):
    root = source_copy(tmp_path)
    out = run(
        root,
        "import pyddp, pyddp._C, pyddp.replicas.model as m; print(pyddp._C.__file__, m.__file__)",
    )
    assert out.returncode == 0, out.stderr
    ext, model = out.stdout.split()
    assert not ext.startswith(str(root)) and not model.startswith(str(root))
    # `python -m` from the root, as the README's quickstart runs it.
    doctor = subprocess.run(
        [sys.executable, "-m", "pyddp.doctor"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert doctor.returncode == 0 and "cpu backend" in doctor.stdout, doctor.stderr


def test_an_edited_source_folder_is_named_in_a_warning(tmp_path):
    root = source_copy(tmp_path)
    with open(root / "pyddp" / "model.py", "a") as f:
        f.write("\n# an edit not installed yet\n")
    out = run(root, "import pyddp")
    assert out.returncode == 0, out.stderr
    assert "running the installed build" in out.stderr and "model.py" in out.stderr


def test_no_build_anywhere_names_the_fix(tmp_path):
    root = source_copy(tmp_path)
    code = (
        "import os, sys\n"
        "from importlib.machinery import EXTENSION_SUFFIXES as S\n"
        "built = lambda p: any(os.path.exists(os.path.join(p, 'pyddp', '_C' + s)) for s in S)\n"
        "sys.path = [p for p in sys.path if not built(p)]\n"
        "import pyddp"
    )
    out = run(root, code)
    assert out.returncode != 0
    assert "pip install ." in out.stderr and "_C" in out.stderr


def test_the_source_differs_warning_gives_the_readme_development_install(tmp_path, monkeypatch):
    # Issue 30, item 19: it said `pip install -e .`, which the README does not
    # use (its build requirements need --no-build-isolation). In-process, so
    # it runs under an editable install too: a source folder without `_C`
    # and an "installed" copy, with a stand-in extension, that differs.
    from pyddp import _source_tree

    source, site = tmp_path / "clone" / "pyddp", tmp_path / "site"
    for folder, text in [(source, "x = 2\n"), (site / "pyddp", "x = 1\n")]:
        folder.mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "model.py").write_text(text)
    (site / "pyddp" / f"_C{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    monkeypatch.syspath_prepend(str(site))
    find_spec = _source_tree.importlib.util.find_spec
    monkeypatch.setattr(
        _source_tree.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pyddp._C" else find_spec(name, *a),
    )
    with pytest.warns(UserWarning, match="model.py") as caught:
        assert _source_tree.use_installed_build([str(source)]) == [str(site / "pyddp")]
    message = str(caught[0].message)
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    develop = "pip install --no-build-isolation -e ."
    assert develop in message and develop in readme
    assert "`pip install -e .`" not in message
