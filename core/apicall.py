"""What the Python API's functions share: signatures generated from the settings the CLI uses,
and packages that are called as functions (`gqakit.convert(...)`, `gqakit.uptrain(...)`).

A package's function and its subpackage have one name: `import gqakit.convert.cli` sets the
attribute `gqakit.convert` to the package, so a function of that name in `gqakit/__init__.py`
would be replaced by it. Instead the package itself is callable (`callable_module`): calling it
calls the function, and `inspect.signature`, `help()` and `__call__.__doc__` show the
function's signature and docstring. Imports neither torch nor pydantic.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

KEYWORD = inspect.Parameter.KEYWORD_ONLY


def field_parameters(fields: Mapping[str, Any], *, skip: Iterable[str] = (),
                     annotations: Mapping[str, Any] | None = None) -> list[inspect.Parameter]:
    """Keyword-only parameters, one per pydantic field (`Model.model_fields`), in field order, with
    the field's annotation and default (None where the default is built by a factory; an
    `annotations` entry replaces a field's annotation). Required fields have no default."""
    out = []
    for name, f in fields.items():
        if name in set(skip):
            continue
        if f.is_required():
            default: Any = inspect.Parameter.empty
        else:
            default = None if f.default_factory is not None else f.default
        annotation = (annotations or {}).get(name, f.annotation)
        out.append(inspect.Parameter(name, KEYWORD, default=default, annotation=annotation))
    return out


def bind(signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a call by name, defaults filled in: Python's own TypeError for a missing,
    unknown or repeated argument."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def callable_module(module_name: str, fn: Callable[..., Any]) -> None:
    """Make the (already imported) module `module_name` callable: calling it calls `fn`."""
    module = sys.modules[module_name]

    def __call__(self: types.ModuleType, *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    __call__.__doc__ = fn.__doc__
    __call__.__signature__ = _with_self(inspect.signature(fn))  # type: ignore[attr-defined]
    cls = type("CallableModule", (types.ModuleType,), {
        "__call__": __call__,
        "__signature__": property(lambda self: inspect.signature(fn)),
        "__module__": __name__,
    })
    module.__class__ = cls


def _with_self(sig: inspect.Signature) -> inspect.Signature:
    """`sig` with a leading `self`, for the method that forwards to the function."""
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return sig.replace(parameters=[self, *sig.parameters.values()])
