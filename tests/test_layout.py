"""The package's rooms stay apart: no import cycle inside pyddp (module- or
function-level), every folder imports only the layers below it (the order in
LAYERS; a room that needs a higher one's internals shows up here first), and
the simulator reads only pyddp's public API."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pyddp

ROOT = Path(pyddp.__file__).resolve().parent


def _modules() -> Dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: Dict[str, Path]) -> Dict[str, Set[str]]:
    """Every import of a pyddp module, at module level or inside a function
    (a function-level import is still an arrow; the compiled _C is a leaf)."""
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in mods and alias.name != mod:
                        graph[mod].add(alias.name)
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names]
            if any(s in mods or s.endswith("._C") for s in subs):
                graph[mod] |= {s for s in subs if s in mods and s != mod}
            elif target in mods and target != mod:
                graph[mod].add(target)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    state: Dict[str, int] = {}
    found: List[List[str]] = []

    def visit(u: str, stack: List[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v) :] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [])
    return found


# pyddp's folders, lowest first: each may import its own folder and those
# before it, never one after it nor the package face (`pyddp/__init__.py`,
# which imports everything). The clients (bench/, doctor/, examples/ and the
# public names at the top) may import anything.
LAYERS = ["errors", "runtime", "_link", "engine", "optim", "replicas", "train", "integrations"]
CLIENTS = {"bench", "doctor", "examples", "lightning", "accelerate", "hf", "ray", "_source_tree"}
# Written by the build beside the compiled modules (what pyddp._hot was built
# against): a leaf below every layer, like _C itself.
GENERATED = {"_hot_build"}


def _layer(mod: str) -> object:
    parts = mod.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] in GENERATED:
        return -1
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else parts[1]


def test_every_module_is_in_a_layer_or_a_client():
    for mod in _modules():
        layer = _layer(mod)
        assert layer == "face" or isinstance(layer, int) or layer in CLIENTS, mod


def test_folders_import_only_the_layers_below():
    graph = _imports(_modules())
    wrong = []
    for mod, deps in graph.items():
        layer = _layer(mod)
        if not isinstance(layer, int):
            continue
        for dep in deps:
            other = _layer(dep)
            if not isinstance(other, int) or other > layer:
                wrong.append(f"{mod} -> {dep}")
    assert wrong == []


def test_the_layer_check_sees_a_function_level_import_up(tmp_path):
    pkg = tmp_path / "pyddp"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "train").mkdir()
    for f in ["__init__.py", "engine/__init__.py", "train/__init__.py", "train/loop.py"]:
        (pkg / f).write_text("")
    (pkg / "engine" / "sync.py").write_text("def f():\n    from ..train import loop\n")
    mods = {}
    for path in pkg.rglob("*.py"):
        parts = path.relative_to(tmp_path).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    assert "pyddp.train.loop" in _imports(mods)["pyddp.engine.sync"]


def test_files_and_folders_stay_small():
    # The size guide (CONTRIBUTING.md, "Size"): a module reads in one sitting, a folder is
    # one part. A file past 450 lines or a folder past 14 modules is a part
    # that wants splitting, said here before it grows further.
    for mod, path in _modules().items():
        assert len(path.read_text().splitlines()) <= 450, (mod, "split it")
    for folder in {p.parent for p in _modules().values()}:
        assert len(list(folder.glob("*.py"))) <= 14, (str(folder), "split it")


def test_no_import_cycle_between_rooms():
    graph = _imports(_modules())
    assert "pyddp._link.processes" in graph  # the walk sees subpackages
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]


def test_the_simulator_reads_public_api_only():
    graph = _imports(_modules())
    for mod, deps in graph.items():
        if mod.startswith("pyddp.bench.simulator"):
            private = {d for d in deps if not d.startswith(("pyddp.bench", "pyddp.engine.observe"))}
            assert private <= {"pyddp"}, (mod, private)


def test_every_deliberate_breakage_still_finds_the_code_it_breaks():
    # tests/simgpu/breakages.py proves the simulated GPU tests bite by
    # breaking the code on purpose; an entry whose text moved away (a
    # refactor) would silently break nothing, so each must match once.
    import importlib.util

    tests = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location("breakages", tests / "simgpu" / "breakages.py")
    breakages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breakages)
    for name, (path, old, new, _what) in breakages.BREAKAGES.items():
        text = (tests.parent / path).read_text()
        olds, news = (old, new) if isinstance(old, tuple) else ((old,), (new,))
        for o, n in zip(olds, news):
            assert text.count(o) == 1, (name, path, o)
            text = text.replace(o, n)
        if path.endswith(".py"):  # the broken variant must still import
            compile(text, path, "exec")


# ---------------------------------------------------------------- the walls
# docs/design.md, "Walls inside the rooms": the Reducer's state is its own;
# the wrapped model (replicas/) drives it through faces.ReplicaDriver, the
# optimizers (optim/) see faces.GradientShards, everyone else calls dmodel.
FACES = {"ReplicaDriver", "GradientShards"}


def _face_members(name: str) -> Set[str]:
    from pyddp.engine import faces

    cls = getattr(faces, name)
    members = set(dir(cls)) | set(getattr(cls, "__annotations__", {}))
    return {m for m in members if not m.startswith("_")}


def _uses_through(tree: ast.AST, ends_with: str) -> Dict[str, List[int]]:
    """Attributes read on any expression whose last name is `ends_with`
    (`self._reducer.x`, `m._reducer.x`, `reducer.x`, `state.reducer.x`)."""
    used: Dict[str, List[int]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        last = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        if last == ends_with:
            used.setdefault(node.attr, []).append(node.lineno)
    return used


def _reaches(mods: Dict[str, Path]) -> Dict[str, List[str]]:
    """What reaches through the walls, by module: `._reducer` outside the
    wrapped model, members outside the faces, the reducer's own state."""
    driver, shards = _face_members("ReplicaDriver"), _face_members("GradientShards")
    # (The link and the work record are the model's too: params.assemble.)
    private = {"_engine", "_layout", "_plan", "_backend", "_observer", "_order"}
    found: Dict[str, List[str]] = {}
    for mod, path in mods.items():
        if mod.startswith("pyddp.engine"):
            continue  # the owner
        tree = ast.parse(path.read_text())
        wrong = found.setdefault(mod, [])
        for attr, lines in _uses_through(tree, "_reducer").items():
            if not mod.startswith("pyddp.replicas"):
                wrong.append(f"_reducer.{attr} (line {lines[0]}): only the wrapped model holds it")
            elif attr not in driver:
                wrong.append(f"_reducer.{attr} (line {lines[0]}) is not in ReplicaDriver")
        if mod.startswith("pyddp.optim"):
            for attr, lines in _uses_through(tree, "reducer").items():
                if attr not in shards:
                    wrong.append(f"reducer.{attr} (line {lines[0]}) is not in GradientShards")
        for node in ast.walk(tree):
            mine = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (
                    mine and node.value.id == "self"  # type: ignore[attr-defined]
                )
            ):
                wrong.append(f"{ast.unparse(node)} (line {node.lineno}): a reducer's state")
        if not found[mod]:
            del found[mod]
    return found


def test_nothing_reaches_through_the_walls():
    mods = _modules()
    assert _reaches(mods) == {}
    # Who may build or import what of engine/: the faces, the options, and
    # the reducer itself only where it is made.
    graph = _imports(mods)
    makers = {"pyddp.replicas.model", "pyddp.engine.sync"}
    for mod, deps in graph.items():
        if "pyddp.engine.reducer" in deps and not mod.startswith("pyddp.engine"):
            assert mod in makers, f"{mod} imports the Reducer"
        if mod.startswith("pyddp.optim"):
            engine = {d for d in deps if d.startswith("pyddp.engine")}
            assert engine <= {"pyddp.engine.faces"}, (mod, engine)


def test_the_wall_check_sees_a_reach(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(model, reducer, m):\n"
        "    model._reducer.engine.buckets\n"
        "    reducer._layout.scattered\n"
        "    reducer.not_a_member\n"
        "    m._reducer.finish()\n"
    )
    found = _reaches({"pyddp.train.x": bad, "pyddp.optim.y": bad, "pyddp.replicas.z": bad})
    assert any("only the wrapped model" in w for w in found["pyddp.train.x"])
    assert any("reducer.not_a_member" in w for w in found["pyddp.optim.y"])
    assert any("a reducer's state" in w for w in found["pyddp.optim.y"])
    assert any("_reducer.engine" in w and "ReplicaDriver" in w for w in found["pyddp.replicas.z"])
    assert not any("_reducer.finish" in w for w in found["pyddp.replicas.z"])


# A class spread over files by mixins: each mixin file opens with a Protocol
# of what it reads from `self` and does not define (CONTRIBUTING.md), and
# the class's files together define everything each Protocol names.
MIXINS = {
    "replicas/steps.py": ("StepsHost", ["replicas/model.py", "replicas/uneven.py"]),
    "replicas/uneven.py": ("JoiningHost", ["replicas/model.py", "replicas/steps.py"]),
    "train/epoch.py": ("EpochHost", ["train/trainer.py", "train/checkpoints/resume.py"]),
    "train/checkpoints/resume.py": ("CheckpointsHost", ["train/trainer.py", "train/epoch.py"]),
}


def _self_attributes(tree: ast.AST, skip: str = "") -> Dict[str, Set[str]]:
    """Attributes of `self` read and defined (assigned, or methods and
    properties) in the classes of a file, the class named `skip` left out."""
    read: Set[str] = set()
    defined: Set[str] = set()
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name != skip]:
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
                (defined if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return {"read": read, "defined": defined}


def _protocol_members(tree: ast.AST, name: str) -> Set[str]:
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    members = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            members.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(node.name)
    return members


def test_each_mixin_says_what_it_reads():
    for rel, (protocol, others) in MIXINS.items():
        tree = ast.parse((ROOT / rel).read_text())
        members = _protocol_members(tree, protocol)
        own = _self_attributes(tree, skip=protocol)
        unsaid = own["read"] - own["defined"] - members
        assert unsaid == set(), (rel, protocol, sorted(unsaid))
        everywhere: Set[str] = set(own["defined"])
        for other in others:
            everywhere |= _self_attributes(ast.parse((ROOT / other).read_text()))["defined"]
        assert members - everywhere == set(), (rel, protocol, "names what no file defines")
