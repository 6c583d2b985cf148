"""Imports run one way between the subpackages of metrale (docs/architecture.md, "Layers of
the package"): every import, at module level or inside a function, goes to a package on a lower
layer. A new cycle, or an import upward, fails here with the line that makes it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "metrale"

# Bottom to top. A package may import the packages of the layers below its own, never its own
# layer's other packages nor anything above.
LAYERS = [
    ("config", "messages"),
    ("kernels", "distributed", "structured"),
    ("layers",),
    ("models", "loader", "multimodal"),
    ("executor",),
    ("engine",),
    ("startup",),
    ("bench", "diagnostics"),
    ("entrypoints",),
]
LAYER_OF = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported metrale module) for every import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("metrale"):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("metrale")]
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYER_OF else None


def test_every_subpackage_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYER_OF), f"give these a layer in LAYERS: {sorted(packages ^ set(LAYER_OF))}"


def test_imports_only_go_down():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = package_of("metrale." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if source is None:
            continue  # metrale/__init__.py: the facade on top may import anything
        for line, module in imports_of(path):
            target = package_of(module)
            if module == "metrale" or (target is not None and target != source
                                       and LAYER_OF[target] >= LAYER_OF[source]):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({source}) imports {module}")
    assert not upward, "imports that go up or sideways:\n" + "\n".join(upward)
