"""Expert backends by name: what ``Plan.expert_backend`` may say.

``torch`` and ``loop`` are built in (``fmoe.layers.experts``). Any other name is a
backend another module registers (``register_expert_backend``) when it is imported,
or one declared as ``name -> module`` so that a plan can name it before that module
is imported (the step then asks for the import, ``fmoe.runtime``). A name is declared
by an installed package under the ``fmoe.expert_backends`` entry-point group (fmoe's
``pyproject.toml`` declares ``te = "interop.te"``), or by ``declare_expert_backend``
(the ``interop`` package calls it on import, which covers a source tree that was
never installed). The core lists no backend beyond its own two.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, NamedTuple

BUILT_IN = ("torch", "loop")
ENTRY_POINT_GROUP = "fmoe.expert_backends"


class ExpertBackend(NamedTuple):
    """An expert MLP implementation selected by ``Plan.expert_backend``.

    Attributes:
        mlp: ``mlp(p, x_RD, segs, cfg, row_probs_R, deferred) -> y_RD`` with
            ``fmoe.layers.expert_mlp``'s meaning and contract.
        check: ``check(plan)`` raises ValueError if the backend cannot run ``plan`` here
            (called by ``fmoe.step`` before any compute).
    """

    mlp: Callable
    check: Callable


_registered: dict[str, ExpertBackend] = {}


def register_expert_backend(name: str, backend: ExpertBackend) -> None:
    """Make ``Plan(expert_backend=name)`` run ``backend`` (``interop.te`` registers ``te``).

    Arguments:
        name: what plans call it.
        backend: its ``ExpertBackend``.

    Raises:
        ValueError: ``name`` is a built-in backend's, or not a non-empty string.
    """
    _check_name("register_expert_backend", name)
    _registered[name] = backend


def _check_name(what: str, name) -> None:
    if not isinstance(name, str) or not name or name in BUILT_IN:
        raise ValueError(f"{what} name={name!r} is invalid: must be a non-empty string other than "
                         + " and ".join(map(repr, BUILT_IN)) + " (built in)")


def registered_backend(name: str) -> ExpertBackend | None:
    """The backend registered under ``name``; None for the built-in ones and names not loaded."""
    return _registered.get(name)


def bound_backend(name: str) -> str | ExpertBackend:
    """What ``Plan.expert_backend`` names, looked up once: a built-in's name (``torch``,
    ``loop``), or the registered ExpertBackend (``fmoe.runtime`` has checked it is)."""
    if name in BUILT_IN:
        return name
    if name not in _registered:
        raise ValueError(f"expert backend {name!r} is not registered in this process: import the module that "
                         f"registers it (or use {' or '.join(map(repr, BUILT_IN))})")
    return _registered[name]


_declared: dict[str, str] | None = None  # read from the installed packages' metadata once


def _declarations() -> dict[str, str]:
    global _declared
    if _declared is None:
        _declared = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _declared


def declared_backends() -> dict[str, str]:
    """``{name: module}`` declared so far (a copy): installed packages' entry points
    (read once per process) and ``declare_expert_backend``'s."""
    return dict(_declarations())


def declare_expert_backend(name: str, module: str) -> None:
    """Let plans name backend ``name`` before ``module`` (which registers it) is imported.

    Arguments:
        name: what plans call it.
        module: the dotted module whose import registers it.

    Raises:
        ValueError: ``name`` is a built-in backend's or not a non-empty string, or
            ``module`` is not a non-empty string.
    """
    _check_name("declare_expert_backend", name)
    if not isinstance(module, str) or not module:
        raise ValueError(f"declare_expert_backend module={module!r} is invalid: must be a dotted module name")
    _declarations()[name] = module


def expert_backend_names() -> tuple[str, ...]:
    """Every name ``Plan.expert_backend`` accepts now: the built-in ones, then the
    registered and declared ones, sorted."""
    return BUILT_IN + tuple(sorted((set(_registered) | set(_declarations())) - set(BUILT_IN)))


__all__ = ["BUILT_IN", "ENTRY_POINT_GROUP", "ExpertBackend", "bound_backend", "declare_expert_backend",
           "declared_backends", "expert_backend_names", "register_expert_backend", "registered_backend"]
