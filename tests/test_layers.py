"""The package's layers run one way: every import under kda/ (module-level and inside functions) is checked
against the allowed arrows below, so that a lower layer never imports a higher one.

    distributed ->  the public API (kda.api), options, errors   (context parallelism: per rank, an ordinary call)
    api (kda, kda.api, kda.report, kda.library, kda.routes, kda.recurrent.api, kda.recurrent.library)
        ->  dispatch, registry, spec, ...
    dispatch  ->  verify, timings, registry, store, spec, config
    verify    ->  backends.base, reference, spec, store, config, workloads, registry  (never bench, api, dispatch)
    bench     ->  the public API (kda), timings, workloads, registry, store, spec  (never verify, dispatch)
    timings   ->  store, spec, config
    registry  ->  backends.*
    backends.*  ->  kda.backends.*, kda.spec, kda.reference, kda.errors, kda.config only
    workloads, store, options, spec, case_class, tensor_info, errors, config, reference, cliargs, _version:
    the bottom
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kda"

BOTTOM = {
    "kda.store",
    "kda.options",
    "kda.spec",
    "kda.case_class",
    "kda.tensor_info",
    "kda.recurrent",
    "kda.recurrent.spec",
    "kda.recurrent.reference",
    "kda.recurrent.gate",
    "kda.errors",
    "kda.config",
    "kda.reference",
    "kda._version",
    "kda.cliargs",
}


def layer_of(module: str) -> str:
    """The layer a kda module belongs to (a module name such as ``kda.verify.check``)."""
    if module in (
        "kda",
        "kda.api",
        "kda.report",
        "kda.library",
        "kda.routes",
        "kda.recurrent.api",
        "kda.recurrent.library",
    ):
        return "api"
    for prefix in ("kda.verify", "kda.bench", "kda.backends", "kda.distributed"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.removeprefix("kda.")
    if module in BOTTOM:
        return "bottom"
    return module.removeprefix("kda.")  # dispatch, registry, timings, workloads, and any new module


# What each layer may import (besides itself and anything outside kda). Bottom modules are named one by one
# where a layer may use only some of them.
ALLOWED: dict[str, set[str]] = {
    "distributed": {"api", *BOTTOM},
    "api": {"dispatch", "registry", "backends.base", *BOTTOM},
    "dispatch": {"verify", "timings", "registry", "backends.base", *BOTTOM},
    "verify": {"backends.base", "registry", "workloads", *BOTTOM},
    "bench": {"api", "timings", "workloads", "registry", *BOTTOM},
    "timings": {"kda.store", "kda.spec", "kda.recurrent.spec", "kda.config", "kda._version"},
    "registry": {"backends", "backends.base", *BOTTOM},
    "backends": {
        "kda.spec",
        "kda.case_class",
        "kda.tensor_info",
        "kda.recurrent.spec",
        "kda.reference",
        "kda.errors",
        "kda.config",
    },
    "workloads": {"kda.spec", "kda.case_class"},
    "bottom": set(BOTTOM),
}

# Single arrows allowed beyond the layer rules, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    # The bench's `fla` baseline times FLA's own function directly, not through kda's dispatch.
    ("kda.bench.runner", "kda.backends.fla"): "the raw FLA baseline",
    ("kda.bench.runner", "kda.backends.fla.route"): "the raw FLA baseline on FLA's Triton path",
    ("kda.bench.decode", "kda.backends.fla.recurrent"): "the raw FLA baseline of the decode op",
    # `chunk_kda(cp_context=...)` hands the call to kda.distributed, which calls chunk_kda per rank.
    ("kda.api", "kda.distributed"): "context parallelism's entry",
    # `--tune-kernels helion` times the helion backend's kernels one by one: it has to know them.
    ("kda.bench.helion_tuning", "kda.backends.helion.configs"): "tuning the helion backend's kernels",
    ("kda.bench.helion_tuning", "kda.backends.helion.forward"): "tuning the helion backend's kernels",
    ("kda.bench.helion_tuning", "kda.backends.helion.runtime"): "tuning the helion backend's kernels",
}


def _is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every kda module that `source` (the text of `module`) imports, anywhere in it, with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((node.lineno, full if _is_module(full) else base))
    return [(line, name) for line, name in found if name == "kda" or name.startswith("kda.")]


def _allowed(importer: str, target: str) -> bool:
    mine, theirs = layer_of(importer), layer_of(target)
    if mine == theirs:
        return True
    if (importer, target) in EXCEPTIONS:
        return True
    allowed = ALLOWED.get(mine, set())
    names = {target, theirs}
    if target == "kda.backends.base" or target.startswith("kda.backends.base."):
        names.add("backends.base")
    return bool(names & allowed)


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """One message per forbidden import in `source`, naming the module, the line and the import."""
    found = {
        f"{module} (line {line}) imports {target}: layer {layer_of(module)!r} may not import layer "
        f"{layer_of(target)!r}": line
        for line, target in imported_modules(module, source, is_package)
        if not _allowed(module, target)
    }
    return sorted(found, key=found.__getitem__)


def package_modules() -> list[tuple[str, Path]]:
    modules = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules.append((".".join(parts), path))
    return modules


def tree_violations(modules: list[tuple[str, Path]]) -> list[str]:
    found = []
    for module, path in modules:
        found += violations(module, path.read_text(), is_package=path.name == "__init__.py")
    return found


def test_every_import_follows_the_layers():
    found = tree_violations(package_modules())
    assert not found, "imports that climb back up the layers:\n" + "\n".join(found)


def test_every_module_has_a_layer_with_rules():
    unknown = {layer_of(m) for m, _ in package_modules()} - set(ALLOWED)
    assert not unknown, f"modules in layers without rules in tests/test_layers.py: {sorted(unknown)}"


@pytest.mark.parametrize(
    ("module", "source", "forbidden"),
    [
        ("kda.backends.fla", "def f():\n    from kda.verify.check import is_verifying\n", "kda.verify.check"),
        ("kda.backends.torch", "import kda.dispatch\n", "kda.dispatch"),
        ("kda.backends.triton.forward", "from kda import api\n", "kda.api"),
        ("kda.backends.flashkda", "from kda.bench import runner\n", "kda.bench.runner"),
        ("kda.verify.cli", "def main():\n    from kda.bench.shapes import MODES\n", "kda.bench.shapes"),
        ("kda.bench.results", "from kda.verify.records import package_versions\n", "kda.verify.records"),
        ("kda.timings", "from kda.verify.records import device_identity\n", "kda.verify.records"),
        ("kda.verify.records", "from kda.dispatch import select\n", "kda.dispatch"),
        ("kda.store", "from kda import timings\n", "kda.timings"),
        ("kda.verify.check", "from ..bench import runner\n", "kda.bench.runner"),
    ],
)
def test_a_forbidden_import_is_reported(module, source, forbidden):
    found = violations(module, source)
    assert len(found) == 1 and found[0].startswith(module) and f"imports {forbidden}:" in found[0], found


def test_a_broken_module_on_disk_fails_the_check(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\n\ndef pin():\n    from kda.verify import check\n")
    found = tree_violations([*package_modules(), ("kda.backends._layers_probe", probe)])
    assert found == [
        "kda.backends._layers_probe (line 5) imports kda.verify.check: layer 'backends' may not import layer 'verify'"
    ]


def test_allowed_imports_pass():
    assert violations("kda.backends.fla", "from kda.backends.base import Backend\nimport triton\n") == []
    assert violations("kda.dispatch", "from kda.verify.records import default_store\n") == []
    assert violations("kda.bench.runner", "import kda\nfrom kda import timings\n") == []
