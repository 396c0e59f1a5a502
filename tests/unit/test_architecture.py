"""The package's shape, held by a test: layers import only downwards, the two judges never import
each other, no module imports another's private names, no constant is defined twice, judging code
stays in readable pieces, and tests and benchmarks stay apart.

Each rule is checked over the source with :mod:`ast` (imports inside functions count as well).
What breaks a rule today and is still to be mended is listed in ``KNOWN`` with the rule's name: a
new break fails the test, and so does a listed one that is gone (take it off the list), so the list
only shrinks. ``test_each_rule_fails_on_a_planted_break`` plants one break per rule in a scratch
package, so that none of the checks passes vacuously.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Lowest first: a module may import its own layer and those below it, never one above.
NATIVE = ("_cstats", "_crecord")  # the C extensions: they import nothing of the package
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", *NATIVE),
    ("trace",),
    ("aten",),
    ("_compat", "seeding"),
    ("capture",),
    ("graph",),
    ("numerics",),
    ("verdict",),
    ("comparison", "checking"),
    ("render",),
    ("overflow", "demo", "facade"),
    ("cli", "__init__", "__main__"),
)
JUDGES = ("comparison", "checking")
SMALL_PACKAGES = ("numerics", "comparison", "checking")  # where functions stay short
MAX_LINES, MAX_PARAMETERS = 80, 8
RESULT_MODULES = ("comparison.result", "checking.result")
HELPERS = "workloads"  # what tests and benchmarks share (models, fault injection); it imports neither

# Breaks still to be mended, by rule. Entries read as the checks below print them.
KNOWN: dict[str, set[str]] = {
    "layers": set(),
    "results import no render": set(),
    "private imports": set(),
    "constants defined once": set(),
    "short functions": {"comparison.api.compare"},
    "tests and benchmarks apart": set(),
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted, without the package name
    target: str  # the imported module, dotted, without the package name
    names: tuple[str, ...]  # the names taken from it (``from target import names``)


def _modules(package: Path) -> dict[str, ast.Module]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).with_suffix("")
        name = ".".join(relative.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _imports(package: Path, modules: dict[str, ast.Module]) -> list[Import]:
    prefix = package.name + "."
    out = []
    for module, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == package.name:
                for alias in node.names:
                    out.append(
                        Import(
                            module,
                            alias.name if alias.name in modules or alias.name in NATIVE else "__init__",
                            (alias.name,),
                        )
                    )
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
                target = node.module[len(prefix) :]
                names = tuple(a.name for a in node.names)
                # ``from pkg.sub import mod`` imports the module pkg.sub.mod
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
                out.append(Import(module, target if not subs else subs[0], names))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(prefix):
                        out.append(Import(module, alias.name[len(prefix) :], ()))
    return out


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"module {module} is in no layer: add its package to LAYERS")


def check_layers(package: Path) -> set[str]:
    """A module that imports a higher layer, or one judge that imports the other."""
    modules = _modules(package)
    found = set()
    for imp in _imports(package, modules):
        if imp.target == "__init__" and all(n.startswith("__") for n in imp.names):
            continue  # __version__
        low, high = imp.module.split(".")[0], imp.target.split(".")[0]
        if _layer(imp.target) > _layer(imp.module) or (low in JUDGES and high in JUDGES and low != high):
            found.add(f"{imp.module} -> {imp.target}")
        elif imp.module in RESULT_MODULES and imp.target.split(".")[-1] in ("report",):
            found.add(f"{imp.module} -> {imp.target}")
    return found


def check_results_import_no_render(package: Path) -> set[str]:
    """A result object importing a renderer: render reads records, results never draw."""
    modules = _modules(package)
    found = set()
    for imp in _imports(package, modules):
        if imp.module in RESULT_MODULES and (imp.target.startswith("render") or imp.target.endswith("report")):
            found.add(f"{imp.module} -> {imp.target}")
    return found


def check_private_imports(root: Path, packages: tuple[str, ...]) -> set[str]:
    """``from x import _name`` across modules (dunders such as ``__version__`` are public)."""
    found = set()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            where = ".".join(path.relative_to(root / package).with_suffix("").parts)
            where = where if package == "tracecmp" else f"{package}/{where}"
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            found.add(f"{where}: from {node.module} import {alias.name}")
    return found


_CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def check_constants(package: Path) -> set[str]:
    """A module-level constant (UPPER_CASE name) assigned the same value in two modules."""
    seen: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, tree in _modules(package).items():
        for node in tree.body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            value = getattr(node, "value", None)
            for target in targets:
                if (
                    isinstance(target, ast.Name)
                    and _CONSTANT.match(target.id)
                    and value is not None
                    and target.id != "__all__"
                ):
                    seen[(target.id.lstrip("_"), ast.dump(value))].append(module)
    return {f"{name} in {', '.join(sorted(where))}" for (name, _), where in seen.items() if len(where) > 1}


def check_function_sizes(package: Path, subpackages: tuple[str, ...]) -> set[str]:
    """Functions over MAX_LINES lines or MAX_PARAMETERS parameters in the judging packages."""
    found = set()
    for module, tree in _modules(package).items():
        if module.split(".")[0] not in subpackages:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                args = node.args
                count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                count -= bool(args.args and args.args[0].arg in ("self", "cls"))
                if lines > MAX_LINES or count > MAX_PARAMETERS:
                    found.add(f"{module}.{node.name}")  # by name: its size moves with every edit
    return found


def check_tests_and_benchmarks_apart(root: Path) -> set[str]:
    """A test importing a benchmark module, a benchmark importing a test module, or the helper
    package both share (:data:`HELPERS`: models, fault injection) importing either."""
    found = set()
    for package, others in (("tests", ("benchmarks",)), ("benchmarks", ("tests",)), (HELPERS, ("tests", "benchmarks"))):
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = (
                    [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else []
                )
                for other in others:
                    if any(n == other or n.startswith(other + ".") for n in names):
                        found.add(f"{path.relative_to(root)} imports {other}")
    return found


RULES = {
    "layers": lambda root: check_layers(root / "tracecmp"),
    "results import no render": lambda root: check_results_import_no_render(root / "tracecmp"),
    "private imports": lambda root: check_private_imports(root, ("tracecmp", "tests", "benchmarks", HELPERS)),
    "constants defined once": lambda root: check_constants(root / "tracecmp"),
    "short functions": lambda root: check_function_sizes(root / "tracecmp", SMALL_PACKAGES),
    "tests and benchmarks apart": check_tests_and_benchmarks_apart,
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_package_keeps_its_shape(rule: str) -> None:
    found = RULES[rule](ROOT)
    new = sorted(found - KNOWN[rule])
    mended = sorted(KNOWN[rule] - found)
    assert not new, f"{rule}: new breaks of the rule (see this file's docstring):\n  " + "\n  ".join(new)
    assert not mended, f"{rule}: these are mended, take them off KNOWN[{rule!r}]:\n  " + "\n  ".join(mended)


def test_each_rule_fails_on_a_planted_break(tmp_path: Path) -> None:
    """A scratch tree with one break of every rule: each check names it."""
    files = {
        "tracecmp/__init__.py": "",
        "tracecmp/errors.py": "LIMIT = 3\n",
        "tracecmp/trace/__init__.py": "from tracecmp.render import draw\n",  # a layer imports upwards
        "tracecmp/render/__init__.py": "def draw():\n    pass\n",
        "tracecmp/checking/__init__.py": "",
        "tracecmp/comparison/__init__.py": "",
        "tracecmp/comparison/result.py": "def render():\n    from tracecmp.render import draw\n",
        "tracecmp/comparison/judge.py": "from tracecmp.checking import thing\nfrom tracecmp.errors import _hidden\nLIMIT = 3\n",
        "tracecmp/numerics/__init__.py": "def long(a, b, c, d, e, f, g, h, i):\n" + "    x = 1\n" * 90,
        "tests/__init__.py": "",
        "tests/test_x.py": "import benchmarks.bench\nimport workloads.models\n",
        "benchmarks/__init__.py": "",
        "benchmarks/bench.py": "from workloads import models\n",
        "workloads/__init__.py": "",
        "workloads/models.py": "from tests import test_x\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    package = tmp_path / "tracecmp"
    assert check_layers(package) == {"trace -> render", "comparison.judge -> checking", "comparison.result -> render"}
    assert check_results_import_no_render(package) == {"comparison.result -> render"}
    assert check_private_imports(tmp_path, ("tracecmp", "tests", "benchmarks")) == {
        "comparison.judge: from tracecmp.errors import _hidden"
    }
    assert check_constants(package) == {"LIMIT in comparison.judge, errors"}
    assert check_function_sizes(package, SMALL_PACKAGES) == {"numerics.long"}
    assert check_tests_and_benchmarks_apart(tmp_path) == {
        "tests/test_x.py imports benchmarks",
        "workloads/models.py imports tests",
    }
