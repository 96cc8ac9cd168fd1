"""HybridSN of Roy et al. (2020): 3-D convolutions for spectral-spatial features, then a 2-D convolution."""

import torch
import torch.nn.functional as F
from torch import nn

from hslite.errors import ModelError


class HybridSN(nn.Module):
    """Three 3-D convs (8@7×3×3, 16@5×3×3, 32@3×3×3), one 2-D conv (64@3×3), FC 256 and 128 with dropout 0.4.

    Roy, Krishna, Dubey, Chaudhuri, "HybridSN: Exploring 3-D-2-D CNN Feature Hierarchy for Hyperspectral Image
    Classification", IEEE GRSL 17(2), 2020, doi:10.1109/LGRS.2019.2918719. The paper feeds 25×25 patches of 30 PCA
    components (the data layer does the PCA); every conv is unpadded, so a patch shrinks by 2 per conv (8 in all)
    and the bands by ``depth - 1`` per 3-D conv. "small" is the paper's network.
    """

    SUMMARY = "3-D then 2-D CNN over the patch (paper input: 25×25 patches of 30 PCA bands)"
    FSDP_UNITS = ("conv3d", "conv2d", "fc")  # FSDP units: fc[0] alone is 90 % of HybridSN
    PAPER = "Roy et al. 2020, HybridSN: Exploring 3-D-2-D CNN Feature Hierarchy for HSI Classification"
    SIZES = {
        "small": {
            "conv3d_channels": (8, 16, 32),
            "conv3d_depths": (7, 5, 3),
            "conv2d_channels": 64,
            "hidden": (256, 128),
            "dropout": 0.4,
        },
        "large": {
            "conv3d_channels": (16, 32, 64),
            "conv3d_depths": (7, 5, 3),
            "conv2d_channels": 128,
            "hidden": (512, 256),
            "dropout": 0.4,
        },
    }

    def __init__(
        self,
        *,
        in_bands: int,
        num_classes: int,
        patch_size: int,
        conv3d_channels: tuple[int, ...],
        conv3d_depths: tuple[int, ...],
        conv2d_channels: int,
        hidden: tuple[int, ...],
        dropout: float,
    ) -> None:
        super().__init__()
        if len(conv3d_channels) != len(conv3d_depths):
            raise ModelError(
                f"hybridsn: conv3d_channels {tuple(conv3d_channels)} and conv3d_depths {tuple(conv3d_depths)} must "
                "have the same length (one depth per 3-D conv)."
            )
        min_bands = sum(d - 1 for d in conv3d_depths) + 1
        if in_bands < min_bands:
            raise ModelError(
                f"hybridsn needs at least {min_bands} bands for its 3-D kernel depths {tuple(conv3d_depths)}; got "
                f"{in_bands}. Keep more bands (e.g. 30 PCA components as in the paper) or pass smaller conv3d_depths."
            )
        num_convs = len(conv3d_depths) + 1
        min_patch = 2 * num_convs + 1
        if patch_size < min_patch:
            raise ModelError(
                f"hybridsn needs patch_size >= {min_patch} for its {num_convs} unpadded 3×3 convs; got {patch_size}. "
                f"Use patch_size={min_patch} or more (the paper uses 25), or a model such as cnn3d."
            )
        channels = (1, *conv3d_channels)
        layer_shapes = zip(channels[:-1], channels[1:], conv3d_depths, strict=True)
        self.conv3d = nn.ModuleList(nn.Conv3d(c_in, c_out, (depth, 3, 3)) for c_in, c_out, depth in layer_shapes)
        bands_left = in_bands - min_bands + 1
        self.conv2d = nn.Conv2d(conv3d_channels[-1] * bands_left, conv2d_channels, 3)
        side_left = patch_size - 2 * num_convs
        widths = (conv2d_channels * side_left * side_left, *hidden)
        self.fc = nn.ModuleList(nn.Linear(w_in, w_out) for w_in, w_out in zip(widths[:-1], widths[1:], strict=True))
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p)."""
        x = x[:, None]
        for conv in self.conv3d:
            x = F.relu(conv(x))
        # Spectral depth folds into 2-D channels, as the paper's reshape to 19×19×576 does.
        x = F.relu(self.conv2d(x.flatten(1, 2)))
        x = x.flatten(1)
        for fc in self.fc:
            x = self.dropout(F.relu(fc(x)))
        return self.classifier(x)
