"""Where the Tinker server keeps what clients save, and the ``tinker://`` paths that name it.

    tinker://<model_id>/weights/<name>          save_state: adapter + optimizer (trainer.py)
    tinker://<model_id>/sampler_weights/<name>  save_weights_for_sampler(name): the adapter

live under ``<run-dir>/runs/<model_id>/checkpoints/{weights,sampler_weights}/<name>/`` (a
model_id's ``:`` become ``-`` in the directory name), beside the run's ``metrics/``. Paths stay
valid across restarts of a server on the same ``--run-dir``.
"""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from grail.tinker.errors import NotFound, UserFault

KINDS = {"weights": "training", "sampler_weights": "sampler"}
# Checked with fullmatch: `$` in a match() also matches before a final newline.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,127}")


def run_dir_of(run_dir: Path, model_id: str) -> Path:
    return run_dir / "runs" / model_id.replace(":", "-")


class Checkpoints:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    def directory(self, model_id: str, kind: str, name: str) -> Path:
        if not _MODEL_ID.fullmatch(model_id):
            raise UserFault(f"model_id {model_id!r} is not one this server issues")
        if not _NAME.fullmatch(name):
            raise UserFault(
                f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (up to 128, "
                "not starting with '.')"
            )
        return run_dir_of(self.run_dir, model_id) / "checkpoints" / kind / name

    @staticmethod
    def path(model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def resolve(self, tinker_path: str, kind: str) -> Path:
        """The directory of an existing ``tinker://<model_id>/<kind>/<name>``."""
        parts = tinker_path.removeprefix("tinker://").split("/")
        if not tinker_path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
            raise UserFault(
                f"{tinker_path!r} is not a checkpoint path (tinker://<model_id>/weights/<name> or "
                "tinker://<model_id>/sampler_weights/<name>)"
            )
        if parts[1] != kind:
            raise UserFault(f"{tinker_path!r} names {parts[1]}, but {kind} are needed here")
        directory = self.directory(parts[0], kind, parts[2])
        if not directory.is_dir():
            raise NotFound(f"no checkpoint {tinker_path} on this server (--run-dir {self.run_dir})")
        return directory

    def list(self, model_id: str) -> list[dict[str, Any]]:
        out = []
        for kind, checkpoint_type in KINDS.items():
            root = run_dir_of(self.run_dir, model_id) / "checkpoints" / kind
            for directory in sorted(root.iterdir()) if root.is_dir() else []:
                files = [p for p in directory.iterdir() if p.is_file()]
                out.append({
                    "checkpoint_id": f"{kind}/{directory.name}",
                    "checkpoint_type": checkpoint_type,
                    "time": datetime.fromtimestamp(directory.stat().st_mtime, UTC).isoformat(),
                    "tinker_path": self.path(model_id, kind, directory.name),
                    "size_bytes": sum(p.stat().st_size for p in files),
                })  # fmt: skip
        return out

    def delete(self, model_id: str, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        if kind not in KINDS:
            raise UserFault(
                f"checkpoint_id {checkpoint_id!r}: expected weights/<name> or "
                "sampler_weights/<name>"
            )
        directory = self.directory(model_id, kind, name)
        if not directory.is_dir():
            raise NotFound(f"no checkpoint {checkpoint_id!r} of model {model_id!r}")
        shutil.rmtree(directory)
