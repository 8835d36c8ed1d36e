"""Objects named as `package.module:attribute` (reward plugins, environment classes): imported,
with an error that says where the module may live when it cannot be found."""

from __future__ import annotations

import importlib
from typing import Any

# Where a plugin module may live. `uv run grail-train` runs the console script, so the working
# directory is not on sys.path; the project's root is (its editable install adds it), as are the
# environment's installed packages and PYTHONPATH.
IMPORTABLE = (
    "put it in the project's root directory (on the path of `uv run grail-train`; the working "
    "directory is not), or add its directory with PYTHONPATH=DIR, or install its package into "
    "the environment (`uv pip install -e DIR`)"
)


class SpecError(ValueError):
    """A `package.module:attribute` spec that does not name an importable object; the message
    says why (the spec itself is the caller's to name)."""


def import_spec(spec: str) -> Any:
    """The object `spec` ("package.module:attr", dotted attributes allowed) names."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise SpecError("not a 'package.module:attribute' spec")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        raise SpecError(
            f"module {module_name!r} not found; {IMPORTABLE}"
            if missing == module_name or module_name.startswith(missing + ".")
            else f"importing module {module_name!r} failed: it needs {missing!r}, which is missing"
        ) from exc
    except Exception as exc:
        raise SpecError(
            f"importing module {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    return obj
