"""Reading a checkpoint for the built-in engine's in-place weight update: the whole checkpoint is
read and checked against the served model before a single weight is copied, so a refused update
leaves the old weights serving."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open


class WeightUpdateError(ValueError):
    """A weight update that was refused; the old weights keep serving."""


def read_checkpoint(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The safetensors tensors in ``path`` (an index's shards, ``model.safetensors``, or every
    ``*.safetensors``), each checked against ``model`` before any is used: every tensor must be a
    weight of the model with its shape, and every parameter must be covered. Raises
    ``WeightUpdateError`` otherwise."""
    if not path.is_dir():
        raise WeightUpdateError(f"model_path {path} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors weights in {path}")

    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise WeightUpdateError(f"{file} is listed in the index but missing")
        read_checked(file, state, tensors, "a weight of the served model")

    _check_covered(tensors, model, str(path))
    return tensors


def check_tensors(tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, what: str) -> None:
    """The same checks as a checkpoint's, for tensors handed over in memory (the shared route,
    tensor_update.py): every tensor a weight of `model` with its shape and a floating dtype
    (the copy converts it to the model's), every parameter covered."""
    state = model.state_dict()
    for name, tensor in tensors.items():
        if name not in state:
            raise WeightUpdateError(f"tensor {name} of {what} is not a weight of the served model")
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise WeightUpdateError(
                f"tensor {name}: shape {list(tensor.shape)} in {what}, model has "
                f"{list(state[name].shape)}"
            )
        if tensor.is_floating_point() != state[name].is_floating_point():
            raise WeightUpdateError(
                f"tensor {name}: dtype {tensor.dtype} in {what}, model has {state[name].dtype}"
            )
    _check_covered(tensors, model, what)


def _check_covered(tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, what: str) -> None:
    # Every parameter must be covered by at least one of its names (tied weights share one).
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    missing = [names[0] for names in aliases.values() if not any(n in tensors for n in names)]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise WeightUpdateError(f"{what} lacks {len(missing)} model weights: {shown}")


def read_checked(
    file: Path,
    served: Mapping[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    what: str,
    served_name: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Add every tensor of the safetensors `file` to `tensors` under its name in the served
    model (`served_name` of its saved name; None: not one of `what`), each checked first: known
    to `served`, there once, with the served tensor's shape. Raises ``WeightUpdateError``
    naming the tensor (or the file, when it cannot be read)."""
    try:
        with safe_open(file, framework="pt", device="cpu") as handle:
            for saved in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                name = served_name(saved)
                if name is None or name not in served:
                    raise WeightUpdateError(f"tensor {saved} in {file.name} is not {what}")
                if name in tensors:
                    raise WeightUpdateError(f"tensor {saved} appears twice in {file.parent}")
                shape = tuple(handle.get_slice(saved).get_shape())
                if shape != tuple(served[name].shape):
                    raise WeightUpdateError(
                        f"tensor {saved}: shape {list(shape)} in {file.name}, model has "
                        f"{list(served[name].shape)}"
                    )
                tensors[name] = handle.get_tensor(saved)
    except WeightUpdateError:
        raise
    except Exception as exc:  # corrupt or unreadable file
        raise WeightUpdateError(f"cannot read {file}: {exc}") from exc
