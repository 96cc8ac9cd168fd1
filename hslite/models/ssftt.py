"""SSFTT of Sun et al. (2022): a 3-D and a 2-D convolution, a Gaussian-weighted tokenizer, one transformer layer."""

import torch
from torch import nn

from hslite.errors import ModelError


class SSFTT(nn.Module):
    """Conv3d 1->c3 (3×3×3) + BN, conv2d (c3·(B−2))->dim (3×3) + BN, tokens -> ``tokens`` semantic tokens, encoder.

    Sun, Zhao, Zheng, Wu, "Spectral–Spatial Feature Tokenization Transformer for Hyperspectral Image
    Classification", IEEE TGRS 60, 2022, doi:10.1109/TGRS.2022.3144158. The paper feeds 13×13 patches of 30 PCA
    components (the data layer does the PCA). Each of the (p−4)² positions of the 2-D feature map is a token; the
    tokenizer's learnt weights ``token_weights`` (tokens × dim, Xavier-initialised as the paper's Gaussian) give each
    semantic token a softmax over the positions, and the token is that mix of the positions' projected features.
    A class token and learnt positions join them; ``depth`` pre-norm encoder layers follow and the class token is
    classified. "small" is the paper's network (8 filters, 64 wide, 4 tokens, 1 layer, 8 heads, MLP 8).
    """

    SUMMARY = "3-D + 2-D convs, Gaussian-weighted tokenizer, transformer (paper input: 13×13 patches of 30 PCA bands)"
    FSDP_UNITS = ("conv2d", "encoder")  # FSDP units: 96 % of the paper's network (the 2-D convolution 84 %)
    PAPER = "Sun et al. 2022, Spectral-Spatial Feature Tokenization Transformer for HSI Classification"
    SIZES = {
        "small": {"conv3d_channels": 8, "dim": 64, "tokens": 4, "depth": 1, "heads": 8, "mlp": 8, "dropout": 0.1},
        "large": {"conv3d_channels": 16, "dim": 128, "tokens": 8, "depth": 2, "heads": 8, "mlp": 128, "dropout": 0.1},
    }

    def __init__(
        self,
        *,
        in_bands: int,
        num_classes: int,
        patch_size: int,
        conv3d_channels: int,
        dim: int,
        tokens: int,
        depth: int,
        heads: int,
        mlp: int,
        dropout: float,
    ) -> None:
        super().__init__()
        if patch_size < 5:
            raise ModelError(
                f"ssftt needs patch_size >= 5 for its two unpadded 3×3 convs; got {patch_size}. Use patch_size=5 or "
                "more (the paper uses 13)."
            )
        if in_bands < 3:
            raise ModelError(f"ssftt needs at least 3 bands for its 3-band spectral kernel; got {in_bands}.")
        if dim % heads:
            raise ModelError(f"ssftt: dim {dim} must be a multiple of heads {heads} (each head takes dim / heads).")
        self.conv3d = nn.Sequential(nn.Conv3d(1, conv3d_channels, 3), nn.BatchNorm3d(conv3d_channels), nn.ReLU())
        self.conv2d = nn.Sequential(nn.Conv2d(conv3d_channels * (in_bands - 2), dim, 3), nn.BatchNorm2d(dim), nn.ReLU())
        self.token_weights = nn.Parameter(nn.init.xavier_normal_(torch.empty(tokens, dim)))
        self.token_values = nn.Linear(dim, dim, bias=False)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.positions = nn.Parameter(torch.empty(1, tokens + 1, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        # Built one by one, not cloned by nn.TransformerEncoder: the pre-flight builds the model on fake tensors, and
        # a deep-copied fake parameter's views get storages of their own (counted as activations; a segfault when
        # its step is counted, torch 2.13).
        self.encoder = nn.Sequential(
            *(
                nn.TransformerEncoderLayer(
                    dim,
                    heads,
                    dim_feedforward=mlp,
                    dropout=dropout,
                    activation="gelu",
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(depth)
            )
        )
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p)."""
        x = self.conv3d(x[:, None])
        # Spectral depth folds into 2-D channels, as the paper's reshape does.
        x = self.conv2d(x.flatten(1, 2))
        positions = x.flatten(2).transpose(1, 2)  # (n, positions, dim)
        weights = torch.softmax(positions @ self.token_weights.T, dim=1)  # each token's mix over the positions
        tokens = weights.transpose(1, 2) @ self.token_values(positions)  # (n, tokens, dim)
        tokens = torch.cat((self.cls_token.expand(len(tokens), -1, -1), tokens), dim=1)
        tokens = self.encoder(self.dropout(tokens + self.positions))
        return self.classifier(self.norm(tokens[:, 0]))
