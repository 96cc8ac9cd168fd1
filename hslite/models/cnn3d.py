"""3-D CNN of Hamida et al. (2018): 3-D convolutions with spectral strides instead of pooling."""

import torch
import torch.nn.functional as F
from torch import nn

from hslite.errors import ModelError


class CNN3D(nn.Module):
    """Four 3-D conv blocks along the bands, strided 3-D convs as pooling, one linear classifier.

    Ben Hamida, Benoit, Lambert, Ben Amar, "3-D Deep Learning Approach for Remote Sensing Image Classification",
    IEEE TGRS 56(8), 2018, doi:10.1109/TGRS.2018.2818945. Layer for layer DeepHyperX's ``HamidaEtAl``:
    conv 1->c1 (3,3,3), pool conv c1->c1 (3,1,1) stride (2,1,1), conv c1->c2 (3,3,3), pool conv c2->c2, conv
    c2->c2 (3,1,1), conv c2->c2 (2,1,1) stride (2,1,1), flatten, linear. "small" is the paper's 20/35 filters.
    A 3×3 patch gets padding 1 on the first conv (as DeepHyperX does) so the second 3×3 conv still fits.
    """

    SUMMARY = "3-D CNN with spectral strides over the patch"
    FSDP_UNITS = ("conv2", "fc")  # FSDP units: the widest convolution and the classifier (92 %)
    PAPER = "Ben Hamida et al. 2018, 3-D Deep Learning Approach for Remote Sensing Image Classification"
    SIZES = {
        "small": {"conv1_channels": 20, "conv2_channels": 35, "dilation": 1},
        "large": {"conv1_channels": 80, "conv2_channels": 140, "dilation": 1},
    }

    def __init__(
        self,
        *,
        in_bands: int,
        num_classes: int,
        patch_size: int,
        conv1_channels: int,
        conv2_channels: int,
        dilation: int,
    ) -> None:
        super().__init__()
        if patch_size < 3:
            raise ModelError(f"cnn3d needs patch_size >= 3 for its 3×3 kernels; got {patch_size}. Use patch_size=3+.")
        c1, c2 = conv1_channels, conv2_channels
        spectral_dilation = (dilation, 1, 1)
        spectral_pad = (1, 0, 0)
        first_pad = 1 if patch_size == 3 else 0
        self.conv1 = nn.Conv3d(1, c1, 3, dilation=spectral_dilation, padding=first_pad)
        self.pool1 = nn.Conv3d(c1, c1, (3, 1, 1), dilation=spectral_dilation, stride=(2, 1, 1), padding=spectral_pad)
        self.conv2 = nn.Conv3d(c1, c2, 3, dilation=spectral_dilation, padding=spectral_pad)
        self.pool2 = nn.Conv3d(c2, c2, (3, 1, 1), dilation=spectral_dilation, stride=(2, 1, 1), padding=spectral_pad)
        self.conv3 = nn.Conv3d(c2, c2, (3, 1, 1), dilation=spectral_dilation, padding=spectral_pad)
        self.conv4 = nn.Conv3d(c2, c2, (2, 1, 1), dilation=spectral_dilation, stride=(2, 1, 1), padding=spectral_pad)
        # The flattened size depends on bands, patch and dilation in ways easiest to get right by running the convs.
        try:
            with torch.no_grad():
                features_size = self._features(torch.zeros(1, in_bands, patch_size, patch_size)).shape[1]
        except RuntimeError as err:
            raise ModelError(
                f"cnn3d cannot run on {in_bands} bands with dilation {dilation}: its spectral kernels do not fit "
                f"({err}). Use more bands{' or a smaller dilation' if dilation > 1 else ''}."
            ) from None
        self.fc = nn.Linear(features_size, num_classes)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x[:, None]))
        x = self.pool1(x)
        x = F.relu(self.conv2(x))
        x = self.pool2(x)
        x = F.relu(self.conv3(x))
        x = F.relu(self.conv4(x))
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p)."""
        return self.fc(self._features(x))
