"""The package's shape, checked: every module imports only from its own layer or the layers below
it, no modules import each other in a circle, and the console scripts point at functions that exist.

Layers (docs/architecture.md): core -> algo / envs / models -> inference -> rollouts -> service /
tinker -> study -> train -> report. Imports under `if TYPE_CHECKING:` count too: a type that must
come from a higher layer is a sign the value travels the wrong way. The whole run config,
`grail.core.config.Config`, is imported only in core/ and train/.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grail"
LAYERS = {
    "core": 0,
    "algo": 1,
    "envs": 1,
    "models": 1,
    "inference": 2,
    "rollouts": 3,
    "service": 4,
    "tinker": 4,
    "study": 5,
    "train": 6,
    "report": 7,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported grail module, line) for every import in `path`, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import module` imports the module
                submodule = f"{base}.{alias.name}"
                yield (submodule if submodule in modules else base), node.lineno


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 and parts[0] == "grail" else None


def test_every_subpackage_has_a_layer() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages - {"schemas"} == set(LAYERS), "a new subpackage needs its place in LAYERS"


def test_modules_import_only_their_own_layer_or_below() -> None:
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        mine = _layer(name)
        for imported, line in _imports(name, path, modules):
            theirs = _layer(imported)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


# The packages that may name the whole run config: its schema, and the layer that owns the run.
CONFIG_PACKAGES = {"core", "train"}


def test_only_core_and_train_import_the_whole_config() -> None:
    """Below train/ a function takes the sections it reads (DataConfig, ...: allowed) or a
    settings object train/ builds from the Config (`grail.train.components.rollout_settings`), so
    what it depends on shows in its signature; report/ reads what runs left on disk."""
    whole = []
    for name, path in sorted(_modules().items()):
        parts = name.split(".")
        if len(parts) > 1 and parts[1] in CONFIG_PACKAGES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = {alias.name for alias in node.names}
            module = node.module if isinstance(node, ast.ImportFrom) else None
            # The module itself (`import grail.core.config`, `from grail.core import config`)
            # would reach the Config as well.
            if (
                (module == "grail.core.config" and names & {"Config", "*"})
                or (module == "grail.core" and "config" in names)
                or (module is None and "grail.core.config" in names)
            ):
                whole.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not whole, "the whole Config imported outside core/ and train/:\n" + "\n".join(whole)


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {
        name: {m for m, _ in _imports(name, path, modules) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package's __init__ is imported with each of its modules, so an edge into a package is
    # an edge into its __init__ only (that is what `modules` names it).
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not circles, "modules that import each other:\n" + "\n".join(sorted(set(circles)))


def test_the_package_root_holds_at_most_three_modules() -> None:
    assert len(list(PACKAGE.glob("*.py"))) <= 3


@pytest.mark.parametrize(
    "script", ["grail-train", "grail-serve", "grail-report", "grail-export-merged"]
)
def test_console_scripts_point_at_functions(script: str) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts[script].partition(":")
    assert callable(getattr(importlib.import_module(module), function))
