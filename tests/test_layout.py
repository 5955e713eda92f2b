"""The package layout's one rule: modules of a package may share private (_) names,
and no private name crosses from one package to another (docs/design.md). cgx._C, the
native module every package reaches C++ through, is the one private name all may use."""

import ast
import pathlib

CGX = pathlib.Path(__file__).resolve().parent.parent / "cgx"
SHARED_PRIVATE = {"_C"}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str, packages: set[str]) -> str:
    """The package a module belongs to: itself where it is one, else its parent."""
    return module if module in packages else module.rpartition(".")[0]


def private_crossings(root: pathlib.Path) -> list[str]:
    """Every private name a module under `root` takes from another package, as
    "importer: module.name"."""
    files = sorted(root.rglob("*.py"))
    packages = {_module_name(f, root) for f in files if f.name == "__init__.py"}
    found = []
    for path in files:
        importer = _module_name(path, root)
        home = _package_of(importer, packages)
        aliases = {}  # local name -> the cgx module it is bound to
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = home.split(".")[: len(home.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != root.name:
                    continue
                for alias in node.names:
                    name = alias.name
                    target = f"{source}.{name}"
                    if target in packages or (root.parent / (target.replace(".", "/") + ".py")).exists():
                        aliases[alias.asname or name] = target  # a module imported by name
                    if name.startswith("_") and not name.startswith("__") and name not in SHARED_PRIVATE:
                        if _package_of(source, packages) != home:
                            found.append(f"{importer}: {source}.{name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root.name:
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                module = aliases.get(base, base if base.split(".")[0] == root.name else None)
                if module and node.attr not in SHARED_PRIVATE and _package_of(module, packages) != home:
                    found.append(f"{importer}: {module}.{node.attr}")
    return found


def test_no_private_name_crosses_a_package():
    assert private_crossings(CGX) == []


def test_the_walk_finds_a_crossing(tmp_path):
    """The rule's own check: a tree with one crossing of each kind, and sharing inside a
    package that is allowed."""
    root = tmp_path / "cgx"
    (root / "front").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "shared.py").write_text("_helper = 1\n")
    (root / "front" / "__init__.py").write_text("")
    (root / "front" / "inner.py").write_text("_own = 1\n")
    (root / "front" / "user.py").write_text(
        "from cgx.front.inner import _own\n"          # inside the package: allowed
        "from cgx import _C\n"                        # the native module: allowed
        "from cgx.shared import _helper\n"            # across: found
        "from ..shared import _helper as h\n"         # across, relative: found
        "import cgx.shared\n"
        "x = cgx.shared._helper\n")                   # across, by attribute: found
    (root / "top.py").write_text("from cgx.front import inner\ny = inner._own\n")  # across: found
    assert sorted(private_crossings(root)) == sorted([
        "cgx.front.user: cgx.shared._helper", "cgx.front.user: cgx.shared._helper",
        "cgx.front.user: cgx.shared._helper", "cgx.top: cgx.front.inner._own"])


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """The loops of module imports under `root` (each as the modules round it): the
    imports a module makes at its top level, those under TYPE_CHECKING too (a loop
    that only type checkers follow is still two modules that need each other), not
    those inside functions (made on first use, as `import cgx` in a function)."""
    files = sorted(root.rglob("*.py"))
    modules = {_module_name(f, root): f for f in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in [n for top in tree.body for n in ([top] + (top.body if isinstance(top, ast.If) else []))]:
            names = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == root.name:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == root.name]
            for name in names:
                if name in modules and name != module and not module.startswith(name + "."):
                    graph[module].add(name)
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"
    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_no_two_modules_import_each_other_directly_or_round_a_loop():
    assert import_cycles(CGX) == []


def test_the_loop_walk_finds_a_loop(tmp_path):
    root = tmp_path / "cgx"
    (root / "pkg").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "pkg" / "__init__.py").write_text("from cgx.pkg.a import A\n")
    (root / "pkg" / "a.py").write_text("from cgx.pkg.b import B\nA = 1\n")
    (root / "pkg" / "b.py").write_text("from cgx.pkg import c\nB = 1\n")
    (root / "pkg" / "c.py").write_text("import cgx.pkg.a\n\ndef f():\n    from cgx.pkg import b\n")
    (root / "pkg" / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from cgx.pkg.e import E\nD = 1\n")
    (root / "pkg" / "e.py").write_text("from cgx.pkg.d import D\nE = 1\n")
    assert import_cycles(root) == [["cgx.pkg.a", "cgx.pkg.b", "cgx.pkg.c", "cgx.pkg.a"],
                                   ["cgx.pkg.d", "cgx.pkg.e", "cgx.pkg.d"]]


def test_no_class_over_400_lines_and_no_file_over_700():
    too_long = []
    for path in sorted(CGX.rglob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > 700:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                too_long.append(f"{path.name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def private_reads_of_other_objects(paths: list[pathlib.Path]) -> list[str]:
    """Every `x._name` in the given modules where x is not the object itself (`self`,
    `cls`, or a weak proxy of self, `weakref.proxy(self)`): an object reaches another only
    through what that one makes public."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        own = {"self", "cls"} | {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                                 and ast.unparse(node.value) == "weakref.proxy(self)"
                                 for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                base = ast.unparse(node.value)
                if base not in own and node.attr not in SHARED_PRIVATE and not base.startswith("cgx"):
                    found.append(f"{path.name}:{node.lineno}: {base}.{node.attr}")
    return found


def test_diloco_and_elastic_read_no_private_name_of_another_object():
    paths = sorted((CGX / "diloco").glob("*.py")) + sorted((CGX / "elastic").glob("*.py"))
    # torch's, not cgx's: a ProcessGroup says its timeout nowhere public.
    torch_s = {"self.group._get_backend", "self.group._get_backend(self.device).options._timeout"}
    assert [read for read in private_reads_of_other_objects(paths) if read.split(": ", 1)[1] not in torch_s] == []


def test_the_private_read_walk_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import weakref\nclass A:\n    def f(self, other):\n        me = weakref.proxy(self)\n"
                    "        return self._x, me._y, other._z, other.__class__\n")
    assert private_reads_of_other_objects([path]) == ["m.py:5: other._z"]
