"""Metrics files: JSON written atomically and validated against the schema shipped in the package.

Every file a run writes under `metrics/` (and `summary.json`) validates against a JSON Schema in
`grail/schemas/`, so tools that read them (`grail-report`, dashboards) can rely on the fields.
A write goes to a temporary file in the same directory, is fsynced, then renamed over the target:
a reader, or a run killed at any moment, never sees a half-written file.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_VERSION = 1
SCHEMAS = ("train_iteration", "eval", "summary")


@cache
def load_schema(name: str) -> dict[str, Any]:
    if name not in SCHEMAS:
        raise ValueError(f"unknown metrics schema {name!r}; known: {', '.join(SCHEMAS)}")
    text = resources.files("grail.schemas").joinpath(f"{name}.schema.json").read_text()
    return json.loads(text)


def validate_metrics(record: dict[str, Any], schema: str) -> None:
    """Raise jsonschema.ValidationError (naming the field) when `record` breaks the schema."""
    jsonschema.validate(record, load_schema(schema))


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_metrics(path: Path, record: dict[str, Any], schema: str) -> None:
    """Validate, then write `record` as JSON atomically."""
    validate_metrics(record, schema)
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_metrics(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
