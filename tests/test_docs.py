"""The python blocks of README.md and docs/*.md that read as whole programs (they begin
with an import) run as written: every name they use is defined in them, and each runs
under torchrun on 2 ranks (skipped where it needs a GPU or a package this machine lacks).
The other blocks are fragments, and the text before each says what it belongs to."""

from __future__ import annotations

import ast
import builtins
import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _blocks() -> list[tuple[str, str, str]]:
    """(where, code, the line before) of every python block in README.md and docs/*.md."""
    blocks = []
    for path in ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            blocks.append((f"{path}:{text[:match.start()].count(chr(10)) + 1}", match.group(1), before))
    return blocks


PROGRAMS = [(where, code) for where, code, _ in _blocks() if re.match(r"(import|from) ", code)]
FRAGMENTS = [(where, before) for where, code, before in _blocks() if not re.match(r"(import|from) ", code)]


def _undefined_names(code: str) -> set[str]:
    """Names the code reads that nothing in it defines (imports, assignments, defs,
    loop and with targets, arguments) and that are not builtins."""
    tree = ast.parse(code)
    defined, used = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, (ast.Store, ast.Del)) else used).add(node.id)
    return used - defined


def test_the_docs_have_whole_programs_to_check():
    assert len(PROGRAMS) >= 6, [w for w, _ in PROGRAMS]


def test_a_fragment_in_the_docs_follows_the_text_that_places_it():
    """A block that is not a whole program comes after a sentence that says where it goes
    (ending in a colon), not straight after a heading."""
    assert [(where, before) for where, before in FRAGMENTS if not before.endswith(":") or before.startswith("#")] == []


@pytest.mark.parametrize("where,code", PROGRAMS, ids=[w for w, _ in PROGRAMS])
def test_a_whole_program_in_the_docs_defines_every_name_it_uses(where, code):
    assert _undefined_names(code) == set(), where


@pytest.mark.parametrize("where,code", PROGRAMS, ids=[w for w, _ in PROGRAMS])
def test_a_whole_program_in_the_docs_runs_under_torchrun(where, code, tmp_path):
    missing = [m for m in ("lightning",) if f"import {m}" in code and importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{where} needs {missing}")
    if '"cuda"' in code.split("#")[0] or 'device="cuda"' in code:
        if not torch.cuda.is_available():
            pytest.skip(f"{where} needs a GPU")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{where}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
