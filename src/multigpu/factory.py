"""``pkg.module:name`` -> the object, with one-line errors (used on both sides of the launch).

Users bring their own work as factories named this way (a model, a workload, a
callback). Importing the module runs its code, as ``python -m`` would: name
only modules you trust.

    model = call_factory("multigpu.infer.models:denoiser", what="--model")

The factory protocol: a factory is a callable taking keyword arguments, called in the ranks
(:meth:`Factory.build`). It may also carry a launcher-side check (:class:`CheckedFactory`), given where it
is defined with :func:`checked_by`::

    def _check_gpt(n_head=4, n_embd=128, **_):          # cheap: no model built, no file read beyond a header
        if n_embd % n_head:
            raise ConfigError(f"n_embd={n_embd} must be divisible by n_head={n_head}")

    @checked_by(_check_gpt)
    def gpt(n_head=4, n_embd=128, **_): ...

:meth:`Factory.check` calls it in the launcher, with the arguments the factory will get, before anything starts.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from multigpu.errors import ConfigError

__all__ = ["CheckedFactory", "Factory", "call_factory", "checked_by", "import_object"]

F = TypeVar("F", bound=Callable[..., Any])


@runtime_checkable
class CheckedFactory(Protocol):
    """A factory with a launcher-side check: the factory protocol's optional part.

    ``factory(**kwargs)`` builds the object in a rank; ``factory.check(**kwargs)`` gets the same keyword arguments
    in the launcher (:meth:`Factory.check`), before any rank starts, and raises a one-line
    :class:`~multigpu.errors.ConfigError` for what the factory would refuse. It must be cheap: no model built, no
    file read beyond its header. Give it with :func:`checked_by`.
    """

    check: Callable[..., None]
    """Called with the factory's keyword arguments; returns nothing, raises ``ConfigError``."""

    def __call__(self, **kwargs: Any) -> Any: ...


def checked_by(check: Callable[..., None]) -> Callable[[F], F]:
    """Decorator: give the factory below its launcher-side ``check`` (:class:`CheckedFactory`); the factory is
    returned as it is, with ``check`` set on it."""

    def attach(factory: F) -> F:
        factory.check = check  # the protocol's attribute (CheckedFactory)
        return factory

    return attach


def _working_directory_last_on_path() -> None:
    """Modules of the working directory import as under ``python -m`` (``--model examples.byo_train:regressor``
    from the repository root failed in the ``multigpu`` console script, which puts only its own folder on the
    path), but *last*, as the worker wrapper puts it in the ranks: an installed module wins over a same-named
    file here. ``-P``/``PYTHONSAFEPATH`` leaves it out."""
    import os
    import sys

    cwd = os.getcwd()
    if not getattr(sys.flags, "safe_path", False) and all(os.path.abspath(p or ".") != cwd for p in sys.path):
        sys.path.append(cwd)


def import_object(spec: str, *, what: str = "factory", callable_only: bool = False) -> Any:
    """Import ``package.module`` and return its attribute ``name``; ConfigError naming ``what`` on any failure.

    ``callable_only``: the name must be callable (a missing one is reported with the module's callables).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r} must look like package.module:name")
    _working_directory_last_on_path()
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


@dataclass(frozen=True, kw_only=True)
class Factory:
    """A config section naming a factory and its arguments: ``{factory: pkg.module:name, kwargs: {...}}``.

    ``context`` values (e.g. ``block_size``, ``vocab_size``) are passed to a factory whose signature
    names them, unless ``kwargs`` does. A factory may carry a ``check`` (:class:`CheckedFactory`, given with
    :func:`checked_by`), a cheap validation :meth:`check` runs in the launcher before anything starts (the
    built-in ones do).
    """

    factory: str
    """``package.module:name`` of a callable."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for it."""

    def _arguments(self, target: Any, context: Mapping[str, Any]) -> dict[str, Any]:
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):  # a builtin without a signature: kwargs only
            return dict(self.kwargs)
        given = {k: v for k, v in context.items() if k in params and k not in self.kwargs and v is not None}
        return {**given, **self.kwargs}

    def check(self, what: str, context: Mapping[str, Any] | None = None) -> None:
        """In the launcher: the factory imports, takes these keyword arguments, and passes its own ``check``
        (:class:`CheckedFactory`), called with the arguments :meth:`build` will pass."""
        target = import_object(self.factory, what=what, callable_only=True)
        args = self._arguments(target, context or {})
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            signature = None
        if signature is not None and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            unknown = sorted(set(self.kwargs) - set(signature.parameters))
            if unknown:
                valid = ", ".join(n for n, p in signature.parameters.items() if p.kind is not p.VAR_POSITIONAL)
                raise ConfigError(f"{what} {self.factory!r} takes no argument {', '.join(map(repr, unknown))} "
                                  f"(from {what.rsplit('.', 1)[0]}.kwargs); valid: {valid or 'none'}")
        if signature is not None:
            self._check_required(what, signature, {**(context or {}), **args})
        if isinstance(target, CheckedFactory) and callable(target.check):
            target.check(**args)

    def _check_required(self, what: str, signature: inspect.Signature, args: Mapping[str, Any]) -> None:
        """Every argument without a default is given (by ``kwargs`` or the context, whose values the ranks may
        only learn later, e.g. the data's ``vocab_size``): a factory the ranks cannot
        call (nanoGPT's ``GPT(config)``) is refused here, before anything starts."""
        missing = [n for n, p in signature.parameters.items() if p.default is p.empty and n not in args
                   and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not missing:
            return
        section, name = what.rsplit(".", 1)[0], self.factory.partition(":")[2]
        given = ", ".join(f"{section}.kwargs.{n}=..." for n in missing)
        raise ConfigError(f"{what} {self.factory!r} cannot be called as it is: {name}() needs "
                          f"{', '.join(map(repr, missing))} (no default); valid: give {given}, or name a function "
                          f"that builds it with no required argument, e.g. def make(): return {name}(...)")

    def build(self, what: str, context: Mapping[str, Any] | None = None) -> Any:
        """In a rank: call the factory with its arguments (and the context values it asks for)."""
        target = import_object(self.factory, what=what, callable_only=True)
        try:
            return target(**self._arguments(target, context or {}))
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's factory can fail in any way
            raise ConfigError(f"{what} {self.factory!r}: calling it failed: {type(exc).__name__}: {exc}") from None
