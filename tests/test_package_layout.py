"""The package reads as its data flow, in layers: a module imports only from its own layer or the ones below it
(imports inside functions counted), no import cycles, modules of a readable size."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tritonmm"
MAX_LINES = 400
LAYERS = (
    ("core",),  # facts and helpers: shapes, layouts, device, environment, modes, activations, reference, timing
    ("kernels",),  # @triton.jit kernels, their configs and launchers
    ("dispatch",),  # decisions, tuned tables, first-sight tuning, weight plans, runners, the padded path, gated paths
    ("ops",),  # the ops in every mode: torch.library registration, autograd, traced bodies, eager routes, DTensor
    ("api",),  # the entry points: matmul, linear, explain, clear_cache
    ("modules",),  # nn.Module integration: swapped, patched and settled Linear; fuse, qkv, packing
    ("tune",),  # tuning ahead of time: tune_model and python -m tritonmm.tune
    ("",),  # the public face: tritonmm/__init__.py
    ("bench", "stress"),  # tools over the public API
)


def _modules() -> dict:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _targets(name: str, path: pathlib.Path, mods: dict) -> set:
    """Every module of the ``tritonmm`` namespace that ``name`` imports, at any depth of its code (inside functions
    too), whether it exists or not."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in mods else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.split(".")[0] == "tritonmm" and m != name}


def _imports(name: str, path: pathlib.Path, mods: dict) -> set:
    """Every tritonmm module ``name`` imports, at any depth of its code (inside functions too)."""
    return {m for m in _targets(name, path, mods) if m in mods}


def _graph() -> dict:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def layer(name: str) -> int:
    """The index in :data:`LAYERS` of module ``name`` (``tritonmm``: the package's public face)."""
    top = name.split(".")[1] if "." in name else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise LookupError(f"{name} is in no layer: place it in one of LAYERS")


def upward(graph: dict) -> list:
    """Each import ``(module, imported)`` of a higher layer than the importer's."""
    return sorted((m, t) for m, targets in graph.items() for t in targets if layer(t) > layer(m))


def _cycle(graph: dict):
    """A cycle of imports, or None. A package's ``__init__`` runs before any of its modules: a module's import of a
    package it lies in is no edge."""
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_every_module_is_in_a_layer():
    missing = []
    for name in _modules():
        try:
            layer(name)
        except LookupError as exc:
            missing.append(str(exc))
    assert not missing, missing


def test_every_import_names_a_module_of_the_tree():
    """Relative imports (inside functions too) name modules that exist: a path left over from a move fails here,
    not at the first call that reaches it."""
    mods = _modules()
    missing = [f"{m}: {t}" for m, p in mods.items() for t in sorted(_targets(m, p, mods)) if t not in mods]
    assert not missing, missing


def test_the_walk_sees_imports_at_any_depth():
    graph = _graph()
    assert "tritonmm.dispatch.runners" in graph["tritonmm.api"]  # at module level
    assert "tritonmm.kernels.launchers" in graph["tritonmm.dispatch.runners"]  # inside a function (Triton on use)
    assert "tritonmm.tune.model" in graph["tritonmm"]  # the face's tune_model


def test_imports_go_only_down_the_layers():
    """core < kernels < dispatch < ops < api < modules < tune < the public face < bench, stress."""
    bad = [f"{m} (layer {LAYERS[layer(m)]}) imports {t} (layer {LAYERS[layer(t)]})" for m, t in upward(_graph())]
    assert not bad, "\n".join(bad)


def test_the_layer_check_finds_an_upward_import():
    graph = {"tritonmm.dispatch.runners": {"tritonmm.ops.grads", "tritonmm.core.env"}, "tritonmm.ops.grads": set(),
             "tritonmm.bench.cli": {"tritonmm"}, "tritonmm": {"tritonmm.tune.model"}}
    assert upward(graph) == [("tritonmm.dispatch.runners", "tritonmm.ops.grads")]


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _cycle({"p.m": {"p"}, "p": {"p.m"}}) is None  # a module importing its own package


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"


MOVED = {"capture": "tune.capture", "device": "core.device", "fusion": "modules.fusion", "gated": "dispatch.gated",
         "gated_cublas": "dispatch.gated_cublas", "nn": "modules.linear", "packing": "modules.packing",
         "qkv": "modules.qkv", "runners": "dispatch.runners", "testing": "core.reference"}


def test_the_0_2_0_paths_of_the_documented_modules_still_import():
    """The module paths the README and the CHANGELOG name (``tritonmm.fusion.fusable``,
    ``tritonmm.runners.KernelFailedWarning``, ...) are the modules of the layers, not copies."""
    import importlib

    import tritonmm

    for old, new in MOVED.items():
        module = importlib.import_module(f"tritonmm.{new}")
        assert importlib.import_module(f"tritonmm.{old}") is module and getattr(tritonmm, old) is module, old
    assert tritonmm.fusion.fusable and tritonmm.packing.stacked and tritonmm.qkv.SERVE_EAGER is False
    assert issubclass(tritonmm.runners.KernelFailedWarning, RuntimeWarning) and tritonmm.gated.GATED_MAX_M
    assert tritonmm.gated_cublas.PACKED_KERNEL_MIN_FLOPS and tritonmm.testing.error_report
    assert not any((PACKAGE / f"{old}.py").exists() for old in MOVED)  # (no copies in the tree)


def test_models_pickled_with_0_2_0_load():
    """A swapped layer and a fused Sequential as 0.2.0 pickled them: their reductions name ``tritonmm.nn`` and
    ``tritonmm.fusion``."""
    import pickle

    import torch

    import tritonmm

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 4))
    tritonmm.fuse(model)
    tritonmm.swap_linear(model)
    data = pickle.dumps(model, protocol=0)
    assert b"ctritonmm.modules.fusion\n_rebuilt_fused" in data and b"ctritonmm.modules.linear\n_rebuilt_swapped" in data
    old = data.replace(b"ctritonmm.modules.fusion\n", b"ctritonmm.fusion\n").replace(
        b"ctritonmm.modules.linear\n", b"ctritonmm.nn\n")
    clone = pickle.loads(old)
    assert type(clone) is type(model) and type(clone[2]) is type(model[2])
    x = torch.randn(3, 8)
    torch.testing.assert_close(clone(x), model(x))


DIAGNOSTICS = PACKAGE.parent / "benchmarks" / "diagnostics"


def stale_names(source: str) -> list:
    """What a script's code names in ``tritonmm`` that the package no longer has (a path left over from a move): a
    module it imports (``from tritonmm.x import a``, ``import tritonmm.x.y``) that does not import, a name it imports
    from one that is neither an attribute nor a submodule, an attribute it reads or sets on the package
    (``tritonmm.NAME``, ``tritonmm.fusion.NAME``) or on a module an import bound (``routes.plans``,
    ``bm._tokens``) that is not there. The script's imports are made first (inside functions too)."""
    import importlib
    import types

    import tritonmm

    tree = ast.parse(source)
    bound, stale = {"tritonmm": tritonmm}, []

    def module(name):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            stale.append(f"import {name}: {exc}")
            return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tritonmm":
            mod = module(node.module)
            for alias in node.names if mod is not None else ():
                if not hasattr(mod, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        stale.append(f"from {node.module} import {alias.name}")
                        continue
                if isinstance(getattr(mod, alias.name), types.ModuleType):
                    bound[alias.asname or alias.name] = getattr(mod, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tritonmm":
                    mod = module(alias.name)
                    if mod is not None and alias.asname:
                        bound[alias.asname] = mod
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.insert(0, value.attr)
            value = value.value
        if not isinstance(value, ast.Name) or value.id not in bound:
            continue
        owner = bound[value.id]
        for attr in chain:  # through modules only: `routes.plans.get` checks `plans`, not a dict's `get`
            owner = getattr(owner, attr, None)
            if not isinstance(owner, types.ModuleType):
                break
        else:
            if not hasattr(owner, node.attr):
                stale.append(f"line {node.lineno}: {'.'.join([value.id, *chain, node.attr])}")
    return stale


@pytest.mark.parametrize("name", sorted(p.name for p in DIAGNOSTICS.glob("*.py")))
def test_diagnostics_name_only_what_the_package_has(name):
    """The diagnostics in benchmarks/diagnostics/ (run by hand on a GPU host) import modules and names of the
    layers, and use attributes of them, that exist: a path left over from a move fails here, not on the GPU host."""
    stale = stale_names((DIAGNOSTICS / name).read_text())
    assert not stale, stale


def test_the_diagnostics_check_finds_stale_names():
    source = """
import tritonmm
import tritonmm.no_such_module
import tritonmm.core.env as env
from tritonmm import routes
from tritonmm._env import raw_env
from tritonmm.bench import model as bm
from tritonmm.dispatch import decide, tuned
from tritonmm.ops import routes as r


def f():
    from tritonmm.dispatch.plans import ROWS_MAX, no_such_name
    tritonmm.fusion.fusable, tritonmm.fusion.no_such_function, tritonmm.no_such_attribute
    decide.weight_free, tuned._table_for, r.plans.get(0), r.linear_keyed, bm._tokens, env.raw_env
    decide.no_such_function, r.no_such_dict.get(0), bm.no_such_helper, env.no_such_switch
    tuned.NO_SUCH_KNOB = 0
"""
    stale = stale_names(source)
    assert [s.split(":")[0] for s in stale[:3]] == ["import tritonmm.no_such_module", "from tritonmm import routes",
                                                    "import tritonmm._env"], stale
    assert stale[3:4] == ["from tritonmm.dispatch.plans import no_such_name"], stale
    assert sorted(s.split(": ")[1] for s in stale[4:]) == [
        "bm.no_such_helper", "decide.no_such_function", "env.no_such_switch", "r.no_such_dict",
        "tritonmm.fusion.no_such_function", "tritonmm.no_such_attribute", "tuned.NO_SUCH_KNOB"], stale
