"""The patch registry: version gate, missing targets, idempotence."""

from __future__ import annotations

import pytest

from vllm_gsd.vllm_v0_32 import patches, registry  # noqa: E402
from vllm_gsd.plugin import register  # noqa: E402


def test_every_patch_targets_something_that_exists_in_the_pinned_vllm():
    patches.declare_all()
    for patch in registry.registered():
        owner, name, current = registry.resolve(patch.target)
        assert current is not None, patch.target
        assert patch.why


def test_every_implementation_named_by_a_patch_exists():
    patches.declare_all()
    for patch in registry.registered():
        assert callable(registry.implementation(patch)), patch.target


def _import_graph() -> dict[str, set[str]]:
    """vllm_gsd's modules and the vllm_gsd modules each imports, anywhere in its source."""
    import ast
    from pathlib import Path

    import vllm_gsd

    root = Path(vllm_gsd.__file__).parent
    files = {".".join(("vllm_gsd", *f.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): f
             for f in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per dot past the first
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                             for alias in node.names}
        graph[name] = {module for module in imported if module in files and module != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()] - seen:
            seen.add(module)
            todo.append(module)
    return seen


def test_vllm_gsd_imports_have_no_cycle_and_the_declarations_no_runner_code():
    graph = _import_graph()
    assert [m for m in graph if m in _reachable(graph, m)] == []
    # Loading the plugin imports the declarations; the runner's hooks come with a gsd worker.
    assert not {m for m in _reachable(graph, "vllm_gsd.vllm_v0_32.patches")
                if m.startswith("vllm_gsd.vllm_v0_32.runner")}


def test_register_is_idempotent():
    register()
    applied = {p.target for p in registry.registered("config") if registry.is_applied(p.target)}
    register()
    assert registry.apply("config") == []  # nothing left to apply
    assert applied == {p.target for p in registry.registered("config")}


def test_version_mismatch_refuses_with_a_clear_message(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(registry.VllmVersionMismatch) as err:
        registry.check_vllm_version()
    assert "0.32.0" in str(err.value) and "0.33.0" in str(err.value)


def test_version_mismatch_applies_nothing(monkeypatch):
    import vllm

    probe = registry.Patch(target="vllm.config.speculative:SpeculativeConfig.compute_hash",
                           why="probe", scope="worker", wrap=lambda f: f)
    monkeypatch.setattr(registry, "_REGISTRY", [probe])
    monkeypatch.setattr(registry, "_APPLIED", set())
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(registry.VllmVersionMismatch):
        registry.apply("worker")
    assert not registry.is_applied(probe.target)


def test_missing_target_is_named_before_anything_is_applied(monkeypatch):
    calls = []
    good = registry.Patch(target="vllm.config.speculative:SpeculativeConfig.compute_hash",
                          why="ok", scope="worker", wrap=lambda f: calls.append(f) or f)
    bad = registry.Patch(target="vllm.config.speculative:SpeculativeConfig.no_such_method",
                         why="gone", scope="worker", wrap=lambda f: f)
    monkeypatch.setattr(registry, "_REGISTRY", [good, bad])
    monkeypatch.setattr(registry, "_APPLIED", set())
    with pytest.raises(registry.PatchTargetMissing) as err:
        registry.apply("worker")
    assert "no_such_method" in str(err.value)
    assert calls == []


def test_kernel_override_scan_passes_llvmlite():
    """vLLM's CPU platform scans every module before a worker starts; with numba loaded (the graph
    core compiles with it) the scan fails on llvmlite's library object unless patched."""
    import vllm.triton_utils.dispatcher as dispatcher

    from vllm_gsd.graph import warm_up

    warm_up()  # numba, hence llvmlite, loaded
    register()
    registry.apply("engine")  # as where a gsd engine's config is built, or a gsd worker starts
    assert registry.is_applied("vllm.triton_utils.dispatcher:_rebind_kernels")
    dispatcher._rebind_kernels([])  # the patched scan
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        dispatcher._rebind_kernels.__wrapped__([])  # vLLM's own


SCAN_SCOPE = r"""
import json, sys
from vllm_gsd.plugin import register
from vllm_gsd.vllm_v0_32 import registry

def state(label):
    import vllm.triton_utils.dispatcher as dispatcher
    scan = dispatcher._rebind_kernels
    print(json.dumps({"label": label, "numba": "numba" in sys.modules, "llvmlite": "llvmlite" in sys.modules,
                      "vllms_own_scan": not hasattr(scan, "__wrapped__") and scan.__module__ == dispatcher.__name__,
                      "engine_scope": registry.is_applied("vllm.triton_utils.dispatcher:_rebind_kernels")}))

register()
state("plugin loaded")
from vllm.engine.arg_utils import EngineArgs
EngineArgs(model=sys.argv[1], skip_tokenizer_init=True).create_engine_config()
state("plain engine config")
EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, speculative_config={
    "method": "gsd", "model": sys.argv[1], "num_speculative_tokens": 8}).create_engine_config()
state("gsd engine config")
"""


def test_the_kernel_scan_is_wrapped_only_where_a_gsd_engine_is_built(tmp_path):
    """A fresh interpreter (no other test's imports): loading the plugin loads no numba and leaves
    vLLM's kernel scan as it is, and so does a plain engine's config; a gsd engine's config
    applies the engine scope, the scan's wrapper with it (numba still unloaded: the graph core
    comes with the drafter)."""
    import json
    import subprocess
    import sys

    from vllm_gsd.testing.tiny_models import config_only_model

    model = config_only_model(tmp_path / "model", 512)
    out = subprocess.run([sys.executable, "-c", SCAN_SCOPE, model], capture_output=True, text=True, timeout=300)
    states = {s["label"]: s for s in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    assert list(states) == ["plugin loaded", "plain engine config", "gsd engine config"], out.stdout + out.stderr[-3000:]
    for label in ("plugin loaded", "plain engine config"):
        assert states[label] == {"label": label, "numba": False, "llvmlite": False, "vllms_own_scan": True,
                                 "engine_scope": False}
    assert states["gsd engine config"] == {"label": "gsd engine config", "numba": False, "llvmlite": False,
                                           "vllms_own_scan": False, "engine_scope": True}


def test_every_use_of_vllm_resolves_in_the_pinned_vllm():
    patches.declare_all()
    assert len(registry.used()) >= 20
    for use in registry.used():
        owner, name, current = registry.resolve(use.target)
        assert current is not None and use.why, use.target


def test_a_use_that_moved_fails_before_any_patch(monkeypatch):
    calls = []
    good = registry.Patch(target="vllm.config.speculative:SpeculativeConfig.compute_hash",
                          why="ok", scope="worker", wrap=lambda f: calls.append(f) or f)
    moved = registry.Uses("vllm.v1.sample.sampler:Sampler.no_such_helper", "gone", "worker")
    monkeypatch.setattr(registry, "_REGISTRY", [good])
    monkeypatch.setattr(registry, "_USES", [moved])
    monkeypatch.setattr(registry, "_APPLIED", set())
    with pytest.raises(registry.PatchTargetMissing, match="no_such_helper"):
        registry.apply("worker")
    assert calls == []


def test_instance_attributes_are_required_by_name():
    from types import SimpleNamespace

    registry.require_attributes(SimpleNamespace(a=1, b=2), ("a", "b"), "Thing")
    with pytest.raises(registry.PatchTargetMissing, match=r"Thing\.b, c"):
        registry.require_attributes(SimpleNamespace(a=1), ("a", "b", "c"), "Thing")
