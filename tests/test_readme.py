"""Every Python block in the README and in docs/*.md runs as pasted, each in a
fresh interpreter, so the documentation cannot rot; every relative link in
them points to a file (and heading) that exists. (The bash quickstart block is
run as written by .ci/run; other bash blocks are not run. Output and
pseudo-code go in ```text blocks.)"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The integration pages' blocks need their framework (an extra) and several
# processes: tests/test_integrations.py runs them. Their links are checked here.
LINKED = [*PAGES, *sorted((ROOT / "docs" / "integrations").glob("*.md"))]


def _name(page: Path) -> str:
    return "README" if page == README else page.relative_to(ROOT).as_posix()


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


BLOCKS = [(f"{_name(p)}-block{k}", code) for p in PAGES for k, code in enumerate(_python_blocks(p))]


def test_the_readme_and_the_docs_have_python_blocks():
    assert len(_python_blocks(README)) >= 2
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_doc_block_runs_as_written(code, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"block failed:\n{code}\n{out.stderr[-3000:]}"


def _without_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (letters,
    digits, '_', '-' and spaces kept), spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = "".join(
            c
            for c in heading.strip().lower()
            if c in " -_" or unicodedata.category(c)[0] in "LNM" or unicodedata.category(c) == "Pc"
        ).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = _without_code(page.read_text())
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", LINKED, ids=[_name(p) for p in LINKED])
def test_relative_links_point_to_existing_files_and_headings(page):
    bad = []
    links = _links(page)
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not bad, f"{page.name}: broken links:\n" + "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme_and_links_back():
    readme_links = set(_links(README))
    for page in LINKED[1:]:
        rel = page.relative_to(ROOT).as_posix()
        assert rel in readme_links, f"README does not link to {rel}"
        back = "../" * (len(page.relative_to(ROOT).parts) - 1) + "README.md"
        assert any(link.startswith(back) for link in _links(page)), (
            f"{rel} does not link back to the README"
        )


# Names on the package index that belong to other projects: "pyddp" is a 2015
# Meteor DDP client (0.1.0 to 0.4.0), so `pip install "pyddp[bench]"` installed it.
TAKEN_ON_THE_INDEX = {"pyddp"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _distribution() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^\[project\]$.*?^name\s*=\s*"([^"]+)"', text, flags=re.S | re.M)
    assert found, "pyproject.toml has no [project] name"
    return found.group(1)


def _install_lines(text: str) -> list[str]:
    """What follows each `pip install` up to the end of its code span, line or
    shell comment (the next line when the command ends a line of prose)."""
    found = []
    for m in re.finditer(r"pip install\b", text):
        rest = text[m.end() :]
        if rest.split("\n", 1)[0].strip() == "":
            rest = rest.split("\n", 1)[-1]
        found.append(re.split(r"[`\n#]", rest, maxsplit=1)[0])
    return found


def test_every_install_from_the_index_names_this_distribution():
    name = _distribution()
    assert _normal(name) not in TAKEN_ON_THE_INDEX, (
        f"pyproject.toml's name {name!r} is another project's on the package index"
    )
    files = [*LINKED, ROOT / ".ci" / "run", *sorted((ROOT / "pyddp").rglob("*.py"))]
    bad, named = [], 0
    for path in files:
        for line in _install_lines(path.read_text()):
            for token in line.split():
                req = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", token.strip("'\"()"))
                project = _normal(req.group(0)) if req else ""
                if project == "pyddp" or project.startswith("pyddp-"):
                    named += 1
                    if project != _normal(name):
                        bad.append(f"{path.relative_to(ROOT)}: pip install{line}")
    assert not bad, f"install lines that do not name {name!r}:\n" + "\n".join(bad)
    assert named >= 3  # docs/simulator.md and the integrations' import errors
    # The installed package's metadata is looked up by the same name.
    init = (ROOT / "pyddp" / "__init__.py").read_text()
    assert re.findall(r'\bversion\("([^"]+)"\)', init) == [name]
