"""The layering is checked, not hoped for (docs/architecture.md): import-linter's contracts in
pyproject.toml, no import cycle between modules, and imports at the top of modules except heavy
optional packages."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "hpcserve"
# Imported inside functions on purpose: heavy, optional, or only present where the code runs there.
HEAVY = ("ray", "vllm", "vllm_router", "vllm_router_rs", "torch", "transformers", "tokenizers", "matplotlib",
         "numpy", "pynvml", "uvloop", "setproctitle", "zmq", "psycopg")


def test_import_linter_contracts_hold(tmp_path):
    done = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--config", str(REPO / "pyproject.toml"),
                           "--no-cache"], capture_output=True, text=True, cwd=REPO / "src", timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    kept = " ".join(done.stdout.split())
    assert "The endpoint's rooms are independent: dataplane and control meet in protocol KEPT" in kept, kept[-2000:]
    assert "endpoint.protocol imports neither room KEPT" in kept, kept[-2000:]


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm over the module graph; components of more than one module are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles():
    assert strongly_connected(grimp.build_graph("hpcserve", cache_dir=None)) == []


def test_imports_are_at_the_top_except_heavy_optional_packages():
    inside = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for_types = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)  # never run: annotations
                     and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING" for n in block.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0 and id(node) not in for_types:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                inside += [f"{path.relative_to(SRC)}:{node.lineno} {n}" for n in names
                           if n.split(".")[0] not in HEAVY]
    assert inside == []


def test_only_the_cli_imports_typer():
    users = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if "import typer" in p.read_text() and p.parent.name != "cli"]
    assert users == []
