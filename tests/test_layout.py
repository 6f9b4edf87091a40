"""The package's parts, and the order their imports keep.

Each module belongs to one part; a module imports only from its own part and
the parts below it (earlier in ``PARTS``), lazily inside functions too. So
the loop never reaches up into a policy, a checkpoint reader or the command
line, and a newcomer reading ``ls mlx_dspark`` sees the parts in this order.
"""

import ast
from pathlib import Path

from test_cli_family import _package_files

import mlx_dspark

# Bottom to top: (part, the modules or folders of mlx_dspark it holds).
PARTS = (
    ("foundation", ("errors", "utils", "blas", "machine", "metal")),
    ("targets", ("targets",)),
    ("sampling", ("sampling",)),
    ("proposers", ("proposers",)),
    ("decoding", ("decoding",)),
    ("policy", ("policy",)),
    ("checkpoints", ("checkpoints",)),
    ("convert", ("convert",)),
    ("pairs", ("pairs",)),
    ("training", ("training",)),
    ("api", ("loading", "generation", "__init__")),
    ("serving", ("serving",)),
    ("benchmark", ("benchmark",)),
    (
        "commands",
        ("cli", "__main__", "generate", "server", "train", "calibrate", "doctor"),
    ),
)
RANK = {member: rank for rank, (_, members) in enumerate(PARTS) for member in members}
PART = {member: part for part, members in PARTS for member in members}

# Modules that only start a command (``python -m mlx_dspark.<command>``).
ENTRY_POINTS = {f"mlx_dspark.{name}" for name in PARTS[-1][1] if name != "cli"}


def _package_imports() -> tuple[dict[str, set[str]], dict[str, Path]]:
    """Every module of the package and the package modules it imports
    (lazily inside functions too), by dotted name."""
    root = Path(mlx_dspark.__file__).parent
    paths = {}
    for path in [*_package_files(), *(root / "cli").glob("*.py")]:
        if path.is_relative_to(root):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
        else:  # the converters, installed as mlx_dspark.convert
            parts = ["mlx_dspark", "convert", path.stem]
        if parts[-1] == "__init__" and len(parts) > 2:
            parts.pop()
        paths[".".join(parts)] = path
    imports = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        if name == "mlx_dspark.__init__":
            package = "mlx_dspark"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = parts[: len(parts) - node.level + 1]
                    module = ".".join([*base, module] if module else base)
                found |= {module, *(f"{module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        imports[name] = {m for m in found if m in paths and m != name}
    return imports, paths


def part_of(module: str) -> str:
    """``python -m`` entry modules (``__main__``) belong to the commands."""
    return "__main__" if module.endswith(".__main__") else module.split(".")[1]


def test_every_module_belongs_to_a_named_part():
    root = Path(mlx_dspark.__file__).parent
    entries = {
        path.stem if path.suffix == ".py" else path.name
        for path in root.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert entries - set(RANK) == set(), "name the new module's part in PARTS"
    imports, _ = _package_imports()
    assert {part_of(m) for m in imports} <= set(RANK)


def test_no_import_runs_from_a_lower_part_back_up():
    imports, _ = _package_imports()
    assert {"mlx_dspark.policy.adaptive", "mlx_dspark.decoding.loop"} <= set(imports)
    upward = sorted(
        f"{name} ({PART[part_of(name)]}) imports {module} ({PART[part_of(module)]})"
        for name, modules in imports.items()
        for module in modules
        if RANK[part_of(module)] > RANK[part_of(name)]
    )
    assert not upward, upward


def test_the_loop_imports_no_concrete_proposer():
    imports, _ = _package_imports()
    proposers = {m for m in imports["mlx_dspark.decoding.loop"] if "proposers" in m}
    assert proposers == {"mlx_dspark.proposers.base"}


def test_library_and_command_line_stand_in_layers():
    imports, paths = _package_imports()
    library = {
        name
        for name, path in paths.items()
        if not name.startswith("mlx_dspark.cli")
        and name not in ENTRY_POINTS
        and path.name != "__main__.py"
    }
    reaching_up = sorted(
        f"{name} imports {module}"
        for name in library
        for module in imports[name]
        if module.startswith("mlx_dspark.cli")
    )
    assert not reaching_up, reaching_up
    circles = sorted(
        f"{a} <-> {b}" for a in library for b in imports[a] if b > a and a in imports[b]
    )
    assert not circles, circles
