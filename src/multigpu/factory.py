"""``pkg.module:name`` -> the object, with one-line errors (used on both sides of the launch).

Users bring their own work as factories named this way (a model, a workload, a
callback). Importing the module runs its code, as ``python -m`` would: name
only modules you trust.

    model = call_factory("multigpu.infer.models:denoiser", what="--model")
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["call_factory", "import_object"]


def import_object(spec: str, *, what: str = "factory", callable_only: bool = False) -> Any:
    """Import ``package.module`` and return its attribute ``name``; ConfigError naming ``what`` on any failure.

    ``callable_only``: the name must be callable (a missing one is reported with the module's callables).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must look like package.module:name")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import can fail in any way
        raise ConfigError(f"{what} {spec!r}: module '{module_name}' does not import "
                          f"({type(exc).__name__}: {exc}); give package.module:name") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None or (callable_only and not callable(obj)):
            names = sorted(n for n in dir(module) if not n.startswith("_")
                           and (not callable_only or callable(getattr(module, n))))
            listed = f"callables there: {', '.join(names[:12]) or 'none'}"
            if callable_only:
                raise ConfigError(f"{what} {spec!r}: '{module_name}' has no callable '{attr}'; {listed}")
            raise ConfigError(f"{what} {spec!r}: '{module_name}' has no '{attr}'; names there: "
                              f"{', '.join(names[:12]) or 'none'}")
    return obj


def call_factory(spec: str, kwargs: Mapping[str, Any] | None = None, *, what: str = "factory") -> Any:
    """``import_object(spec)(**kwargs)``; ConfigError when it is not callable or the call fails."""
    factory = import_object(spec, what=what, callable_only=True)
    try:
        return factory(**dict(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - the user's factory can fail in any way
        name = spec.partition(":")[2]
        raise ConfigError(f"{what} {spec!r}: calling {name}() failed: {type(exc).__name__}: {exc}") from None
