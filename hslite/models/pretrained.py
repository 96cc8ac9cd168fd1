"""Fine-tuning from a local pretrained checkpoint: weights loaded safely, every key accounted for, backbone frozen.

`model.pretrained=PATH` loads a state dict (a plain one, or a Lightning checkpoint's `state_dict`, hslite's own runs
included) into the freshly built model before training. A `.safetensors` file, as foundation-model weights are shared,
is read with `safetensors.torch.load_file` (the optional `hslite[safetensors]`); any other file with
`torch.load(weights_only=True)`. Either way a checkpoint is data, never code. Keys must match the architecture both
ways, with the shapes it has; what a new scene changes on purpose (the head, for another number of classes) is named
in `model.pretrained_exclude` and keeps its fresh initialisation. `model.freeze_backbone=true` then trains only those
excluded parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from hslite.errors import ModelError, first_line, unreadable

# A Lightning checkpoint of hslite's task keeps the network under this attribute (`HSIClassifier.model`); the task's
# other entries (the loss's class weights, metric states) are not the network's.
TASK_PREFIX = "model."
SAFETENSORS_SUFFIX = ".safetensors"


def load_pretrained(model: nn.Module, path: str | Path, exclude: Sequence[str] = (), freeze: bool = False) -> int:
    """Load `path`'s weights into `model` except the `exclude` prefixes; freeze what was loaded when `freeze`.

    Returns the number of parameters left trainable. Refused with a sentence (and `model` untouched) when the file
    is missing or not a state dict, or when keys are missing, unexpected or of another shape.
    """
    path = Path(path)
    state = _safetensors_state(path) if path.suffix.lower() == SAFETENSORS_SUFFIX else _state_dict(path)
    own = model.state_dict()
    wanted = {k: v for k, v in own.items() if not _excluded(k, exclude)}
    missing = sorted(set(wanted) - set(state))
    unexpected = sorted(k for k in state if k not in own and not _excluded(k, exclude))
    reshaped = [k for k in wanted if k in state and tuple(state[k].shape) != tuple(wanted[k].shape)]  # model order
    if missing or unexpected:
        raise ModelError(_mismatch(path, type(model).__name__, missing, unexpected, reshaped, own, state))
    if reshaped:
        raise ModelError(_reshaped(path, type(model).__name__, reshaped, own, state))
    model.load_state_dict({k: state[k] for k in wanted}, strict=False)
    if freeze:
        for name, param in model.named_parameters():
            param.requires_grad_(_excluded(name, exclude))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if freeze and not trainable:
        raise ModelError(
            f"model.freeze_backbone=true froze every parameter: name the part to train in model.pretrained_exclude "
            f"(a prefix of its parameters, e.g. {_top_level(own)[-1]!r})."
        )
    return trainable


def _safetensors_state(path: Path) -> dict[str, Tensor]:
    """A `.safetensors` file's tensors by name: a flat state dict, used as it is (no Lightning prefix to strip)."""
    _require_file(path)
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ModelError(
            f"model.pretrained={path} is a .safetensors file, which needs the safetensors package: "
            'pip install "hslite[safetensors]".'
        ) from None
    try:
        return load_file(str(path), device="cpu")  # a str, which every safetensors release takes
    except Exception as err:  # a truncated or foreign file (safetensors' errors say why and never advise unpickling)
        raise ModelError(
            f"model.pretrained={path} is not a .safetensors file that can be read ({first_line(err)}); save the "
            "network's state_dict() with safetensors.torch.save_file."
        ) from err


def _state_dict(path: Path) -> dict[str, Tensor]:
    _require_file(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable or unsafe file ends here
        why, cause = unreadable(err)
        raise ModelError(
            f"model.pretrained={path} is not a checkpoint of tensors that can be read safely: {why}; save the "
            "network's state_dict() with torch.save or safetensors.torch.save_file."
        ) from cause
    state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
    if not isinstance(state, Mapping) or not all(torch.is_tensor(v) for v in state.values()):
        raise ModelError(
            f"model.pretrained={path} holds {type(loaded).__name__}, not a state dict (names to tensors); save the "
            "network's state_dict() with torch.save, or give a Lightning checkpoint."
        )
    if state is not loaded and any(k.startswith(TASK_PREFIX) for k in state):  # a Lightning checkpoint of hslite's
        state = {k[len(TASK_PREFIX) :]: v for k, v in state.items() if k.startswith(TASK_PREFIX)}
    return dict(state)


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise ModelError(
            f"model.pretrained={path}: no such file; give the path of a .pt/.ckpt state dict or a .safetensors file."
        )


def _excluded(key: str, exclude: Sequence[str]) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in exclude)


def _top_level(state: Mapping[str, Tensor]) -> list[str]:
    return list(dict.fromkeys(k.split(".")[0] for k in state))


def _mismatch(
    path: Path,
    model_name: str,
    missing: list[str],
    unexpected: list[str],
    reshaped: list[str],
    own: Mapping[str, Tensor],
    state: Mapping[str, Tensor],
) -> str:
    def some(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    parts = [f"{len(missing)} missing ({some(missing)})"] if missing else []
    parts += [f"{len(unexpected)} unexpected ({some(unexpected)})"] if unexpected else []
    parts += [
        f"{len(reshaped)} of another shape ("
        + ", ".join(f"{k}: {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here" for k in reshaped[:3])
        + ")"
    ] if reshaped else []  # fmt: skip
    return (
        f"model.pretrained={path} does not fit {model_name} as built for this scene: keys {'; '.join(parts)}. "
        f"Build the same architecture (model.name, model.size, data.patch_size, bands) as the checkpoint, and name "
        f"what this scene changes on purpose in model.pretrained_exclude (top-level parts: "
        f"{', '.join(_top_level(own))})."
    )


def _reshaped(
    path: Path, model_name: str, reshaped: list[str], own: Mapping[str, Tensor], state: Mapping[str, Tensor]
) -> str:
    """One sentence for keys that all match but some shapes do not: the first such tensor, and the exclude to add."""
    first, others = reshaped[0], reshaped[1:]
    more = f" (and {len(others)} more of another shape: {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
    owners = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in reshaped))  # the modules that hold them
    part = "that part" if len(owners) == 1 else "those parts"
    return (
        f"model.pretrained={path} does not fit {model_name} as built for this scene: its tensor {first} is "
        f"{tuple(state[first].shape)} in the file but {tuple(own[first].shape)} in the model{more if others else ''}; "
        f"add model.pretrained_exclude=[{','.join(owners)}] to keep {part} freshly initialised, or build the "
        "architecture the checkpoint was trained with (model.name, model.size, data.patch_size, bands)."
    )
