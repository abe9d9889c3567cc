"""The layer rule of the packages, read from the source with `ast`: every import counts (module level,
inside functions, under `if TYPE_CHECKING:`), relative ones resolved.

    rtserver.config <- rtserver.engine <- rtserver.tasks <- rtserver.web <- rtserver.cli <- rtbench
                       rtserver.engine <- rtserver.remote <- rtserver.web

A layer imports only from the layers to its left; rtbench (the measuring tools) sits on top of
rtserver, and nothing in rtserver imports it; rtserver.remote (the remote inference backend) is a
sibling of the local engine beside it: it uses the engine's seam, and neither knows the other's
insides; rtserver.config imports no other rtserver module; rtserver.web.cluster (the Redis store
behind the web layer) imports none of the front doors (app, hub, console, state, HTTP API) nor the
engine or remote backend; and there is no import cycle between rtserver modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rtbench
import rtserver

PACKAGE_DIR = Path(rtserver.__file__).resolve().parent
TOOLS_DIR = Path(rtbench.__file__).resolve().parent
PACKAGES = ("rtserver", "rtbench")  # the import graph's nodes and edges stay within these

# layer -> what it must not import (each a module or a package prefix)
FORBIDDEN = {
    "rtserver": ("rtbench",),  # the measuring tools sit on top: the server never needs them
    "rtserver.engine": (
        "rtserver.remote",
        "rtserver.tasks",
        "rtserver.web",
        "rtserver.cli",
    ),
    "rtserver.remote": (
        "rtserver.engine.core",
        "rtserver.engine.scheduler",
        "rtserver.engine.runner",
        "rtserver.engine.kv",
        "rtserver.tasks",
        "rtserver.web",
        "rtserver.cli",
    ),
    "rtserver.tasks": ("rtserver.remote", "rtserver.web", "rtserver.cli"),
    "rtserver.web": ("rtserver.cli",),
    # the Redis store behind the web layer (many nodes as one): the front doors use it, never the reverse
    "rtserver.web.cluster": (
        "rtserver.web.app",
        "rtserver.web.hub",
        "rtserver.web.console",
        "rtserver.web.state",
        "rtserver.web.http_api",
        "rtserver.engine",
        "rtserver.remote",
    ),
}
STANDALONE = ("rtserver.config",)  # imports no other rtserver module

Graph = dict[str, set[str]]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def module_names(root: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package's __init__.py is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _packages(modules: set[str]) -> set[str]:
    """Every package the modules live in (namespace packages, without __init__.py, included)."""
    return {m.rsplit(".", i)[0] for m in modules for i in range(1, m.count(".") + 1)}


def imports_of(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The rtserver and rtbench modules (or packages) that `source`, the text of `module`, imports
    anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise ValueError(f"{module}: relative import beyond the top-level package")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else base)
    return {t for t in targets if any(_within(t, p) for p in PACKAGES)}


def import_graph(roots: tuple[Path, ...] = (PACKAGE_DIR, TOOLS_DIR)) -> Graph:
    modules = {name: path for root in roots for name, path in module_names(root).items()}
    known = set(modules) | _packages(set(modules))
    return {
        name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", known) - {name}
        for name, path in modules.items()
    }


def layer_violations(graph: Graph) -> list[str]:
    problems = []
    for module, targets in sorted(graph.items()):
        for layer, forbidden in FORBIDDEN.items():
            if _within(module, layer):
                for target in sorted(targets):
                    if any(_within(target, f) for f in forbidden):
                        problems.append(f"{module} imports {target} (the {layer} layer must not)")
        if module in STANDALONE:
            for target in sorted(targets):
                if target != module:
                    problems.append(f"{module} imports {target} (it imports no other rtserver module)")
    return problems


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. Edges to names that are not nodes are ignored."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


# -- the tree as it is ------------------------------------------------------------------------------


def test_the_graph_covers_every_layer():
    graph = import_graph()
    for layer in (
        "rtserver.config",
        "rtserver.engine.core",
        "rtserver.tasks",
        "rtserver.web.hub",
        "rtserver.cli",
    ):
        assert layer in graph, sorted(graph)
    assert any(m.startswith("rtbench.") for m in graph)
    assert "rtserver.cli" in graph["rtbench.commands"]  # a tool command reuses the server's loading
    # a sample of what the graph must see: a relative import, a function-level one
    assert "rtserver.engine.backend" in graph["rtserver.engine.core"]
    assert "rtserver.web.server" in graph["rtserver.cli"]  # inside cmd_serve


def test_layers_import_only_downwards():
    problems = layer_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# -- the checker itself: it finds what it is there to find ------------------------------------------

KNOWN = {
    "rtserver",
    "rtserver.config",
    "rtserver.engine",
    "rtserver.engine.core",
    "rtserver.engine.backend",
    "rtserver.web",
    "rtserver.web.app",
    "rtserver.web.hub",
    "rtserver.tasks",
    "rtserver.tasks.declare",
}


@pytest.mark.parametrize(
    "source",
    [
        "from ..web.app import create_app",
        "from ..web import app",
        "import rtserver.web.app",
        "from rtserver.web.hub import Hub",
        "def f():\n    from ..web import hub\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..web.app import create_app\n",
        "class C:\n    def m(self):\n        import rtserver.web\n",
    ],
)
def test_engine_importing_web_is_caught_however_written(source):
    targets = imports_of(source, "rtserver.engine.core", False, KNOWN)
    assert any(_within(t, "rtserver.web") for t in targets), targets
    problems = layer_violations({"rtserver.engine.core": targets})
    assert problems and "rtserver.engine.core imports rtserver.web" in problems[0], problems


def test_relative_imports_resolve_from_modules_and_packages():
    assert imports_of("from .backend import X", "rtserver.engine.core", False, KNOWN) == {
        "rtserver.engine.backend"
    }
    assert imports_of("from . import backend", "rtserver.engine.core", False, KNOWN) == {
        "rtserver.engine.backend"
    }
    assert imports_of("from ..config import S", "rtserver.engine.core", False, KNOWN) == {"rtserver.config"}
    assert imports_of("from . import X", "rtserver.engine.core", False, KNOWN) == {"rtserver.engine"}
    # in a package's __init__.py, `.` is the package itself
    assert imports_of("from .declare import Task", "rtserver.tasks", True, KNOWN) == {
        "rtserver.tasks.declare"
    }
    assert imports_of("from ..config import S", "rtserver.tasks", True, KNOWN) == {"rtserver.config"}
    # other packages' imports do not count
    assert (
        imports_of("import os\nfrom torch import nn\nimport rtserverx", "rtserver.config", False, KNOWN)
        == set()
    )
    with pytest.raises(ValueError, match="beyond the top-level package"):
        imports_of("from ... import x", "rtserver.engine.core", False, KNOWN)


def test_layer_rules_on_a_synthetic_graph():
    ok: Graph = {
        "rtserver.config": set(),
        "rtserver.engine.core": {"rtserver.config", "rtserver.engine.backend"},
        "rtserver.tasks.run": {"rtserver.engine.backend", "rtserver.tasks.declare"},
        "rtserver.web.app": {"rtserver.tasks.registry", "rtserver.engine.core", "rtserver.config"},
        "rtbench.bench": {"rtserver.web.server", "rtserver.engine.core"},
        "rtbench.commands": {"rtbench.bench", "rtserver.cli"},
        "rtserver.cli": {"rtserver.tasks.fit_heads", "rtserver.web.server"},
    }
    assert layer_violations(ok) == []
    bad = {
        "rtserver.engine.core": {"rtserver.web.app"},
        "rtserver.engine.kv": {"rtserver.tasks"},
        "rtserver.tasks.chat": {"rtbench.stats"},
        "rtserver.web.hub": {"rtserver.cli"},
        "rtserver.cli": {"rtbench.commands"},
        "rtserver.config": {"rtserver.engine.backend"},
        "rtserver.engine.model": {"rtserver.engine.backend", "rtserver.config"},  # allowed
        "rtserver.webx": {"rtserver.cli"},  # not the web layer: a name that only starts like it
        "rtserver.tasks.run": {"rtbenchx"},  # not the tools: a name that only starts like them
    }
    assert layer_violations(bad) == [
        "rtserver.cli imports rtbench.commands (the rtserver layer must not)",
        "rtserver.config imports rtserver.engine.backend (it imports no other rtserver module)",
        "rtserver.engine.core imports rtserver.web.app (the rtserver.engine layer must not)",
        "rtserver.engine.kv imports rtserver.tasks (the rtserver.engine layer must not)",
        "rtserver.tasks.chat imports rtbench.stats (the rtserver layer must not)",
        "rtserver.web.hub imports rtserver.cli (the rtserver.web layer must not)",
    ]


def test_find_cycle_on_synthetic_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"outside"}}) is None
