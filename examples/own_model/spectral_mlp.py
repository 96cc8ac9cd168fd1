"""An hslite model plugin: an MLP on a patch's centre-pixel spectrum beside the patch's mean spectrum.

What makes it an hslite model is the model protocol (`hslite.models.ModelClass`): SUMMARY, PAPER and SIZES class
attributes, and a constructor taking `in_bands`, `num_classes`, `patch_size` and one preset's keywords, building a
module that maps patches (n, in_bands, p, p) to logits (n, num_classes). FSDP_UNITS is optional: the submodules
FSDP shards one at a time (`parallel.fsdp=true`).
"""

import torch
from torch import nn


class SpectralMLP(nn.Module):
    """Centre spectrum and window-mean spectrum, concatenated, through a two-layer MLP."""

    SUMMARY = "MLP on the centre spectrum and the window-mean spectrum (example plugin)"
    PAPER = ""  # a team's own design: no paper to cite
    SIZES = {
        "small": {"hidden": 128, "dropout": 0.1},
        "large": {"hidden": 1024, "dropout": 0.2},
    }
    FSDP_UNITS = ("hidden",)

    def __init__(self, *, in_bands: int, num_classes: int, patch_size: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.centre = patch_size // 2
        self.hidden = nn.Sequential(nn.Linear(2 * in_bands, hidden), nn.GELU(), nn.Dropout(dropout))
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p)."""
        features = torch.cat([x[:, :, self.centre, self.centre], x.mean(dim=(2, 3))], dim=1)
        return self.classifier(self.hidden(features))
