"""Fine-tuning from a local pretrained checkpoint: weights loaded safely, every key accounted for, backbone frozen.

`model.pretrained=PATH` loads a state dict (a plain one, or a Lightning checkpoint's `state_dict`, hslite's own runs
included) into the freshly built model before training. The file is read with `torch.load(weights_only=True)`: a
checkpoint is data, never code. Keys must match the architecture both ways, with the shapes it has; what a new scene
changes on purpose (the head, for another number of classes) is named in `model.pretrained_exclude` and keeps its
fresh initialisation. `model.freeze_backbone=true` then trains only those excluded parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from hslite.errors import ModelError

# A Lightning checkpoint of hslite's task keeps the network under this attribute (`HSIClassifier.model`); the task's
# other entries (the loss's class weights, metric states) are not the network's.
TASK_PREFIX = "model."


def load_pretrained(model: nn.Module, path: str | Path, exclude: Sequence[str] = (), freeze: bool = False) -> int:
    """Load `path`'s weights into `model` except the `exclude` prefixes; freeze what was loaded when `freeze`.

    Returns the number of parameters left trainable. Refused with a sentence (and `model` untouched) when the file
    is missing or not a state dict, or when keys are missing, unexpected or of another shape.
    """
    state = _state_dict(Path(path))
    own = model.state_dict()
    wanted = {k: v for k, v in own.items() if not _excluded(k, exclude)}
    missing = sorted(set(wanted) - set(state))
    unexpected = sorted(k for k in state if k not in own and not _excluded(k, exclude))
    reshaped = sorted(k for k in wanted if k in state and tuple(state[k].shape) != tuple(wanted[k].shape))
    if missing or unexpected or reshaped:
        raise ModelError(_mismatch(Path(path), type(model).__name__, missing, unexpected, reshaped, own, state))
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


def _state_dict(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise ModelError(f"model.pretrained={path}: no such file; give the path of a .pt/.ckpt state dict.")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable or unsafe file ends here, with the reason torch gave
        raise ModelError(
            f"model.pretrained={path} is not a checkpoint of tensors that can be read safely "
            f"({type(err).__name__}: {str(err).splitlines()[0]}); save the network's state_dict() with torch.save."
        ) from err
    state = loaded.get("state_dict", loaded) if isinstance(loaded, Mapping) else None
    if not isinstance(state, Mapping) or not all(torch.is_tensor(v) for v in state.values()):
        raise ModelError(
            f"model.pretrained={path} holds {type(loaded).__name__}, not a state dict (names to tensors); save the "
            "network's state_dict() with torch.save, or give a Lightning checkpoint."
        )
    if state is not loaded and any(k.startswith(TASK_PREFIX) for k in state):  # a Lightning checkpoint of hslite's
        state = {k[len(TASK_PREFIX) :]: v for k, v in state.items() if k.startswith(TASK_PREFIX)}
    return dict(state)


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
