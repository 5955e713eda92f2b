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
