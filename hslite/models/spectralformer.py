"""SpectralFormer of Hong et al. (2022): a transformer whose tokens are groups of neighbouring bands."""

import torch
from torch import nn

from hslite.errors import ModelError


class SpectralFormer(nn.Module):
    """Group-wise spectral embedding (GSE), cls token, pre-norm transformer with cross-layer adaptive fusion (CAF).

    Hong, Han, Yao, Gao, Zhang, Plaza, Chanussot, "SpectralFormer: Rethinking Hyperspectral Image Classification
    With Transformers", IEEE TGRS 60, 2022, doi:10.1109/TGRS.2021.3130716; layout of the authors' ``vit_pytorch.py``.

    GSE: token i is a linear embedding of bands i-k..i+k (``near_bands`` = 2k+1, wrapping round the spectrum as
    the authors' ``gain_neighborhood_band`` does) over every pixel of the patch, so there is one token per band.
    CAF: from the third layer on, a layer's input is fused with the input of the layer two below it by a learned
    1×2 convolution whose channels are the tokens. "small" is the paper's setting (dim 64, depth 5, 4 heads of 16,
    MLP 8, dropout 0.1).
    """

    SUMMARY = "transformer over groups of neighbouring bands with cross-layer fusion"
    FSDP_UNITS = ("layers", "skipcat")  # FSDP units; a ModuleList gives one unit per item
    PAPER = "Hong et al. 2022, SpectralFormer: Rethinking HSI Classification With Transformers"
    SIZES = {
        "small": {"dim": 64, "depth": 5, "heads": 4, "mlp_dim": 8, "near_bands": 3, "dropout": 0.1},
        "large": {"dim": 256, "depth": 8, "heads": 8, "mlp_dim": 512, "near_bands": 3, "dropout": 0.1},
    }

    def __init__(
        self,
        *,
        in_bands: int,
        num_classes: int,
        patch_size: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_dim: int,
        near_bands: int,
        dropout: float,
    ) -> None:
        super().__init__()
        if near_bands < 1 or near_bands % 2 == 0 or near_bands > in_bands:
            raise ModelError(
                f"spectralformer: near_bands must be odd and at most the {in_bands} bands; got {near_bands}. "
                f"Use near_bands={min(3, in_bands - 1 + in_bands % 2)} (the paper uses 3)."
            )
        if dim % heads:
            raise ModelError(f"spectralformer: dim {dim} must be a multiple of heads {heads}; change one of them.")
        self.near_bands = near_bands
        num_tokens = in_bands + 1
        self.embed = nn.Linear(near_bands * patch_size * patch_size, dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, num_tokens, dim) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, mlp_dim, dropout, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.skipcat = nn.ModuleList(nn.Conv2d(num_tokens, num_tokens, (1, 2)) for _ in range(max(depth - 2, 0)))
        self.classifier = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))

    def group_spectral_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (n, bands, dim): band i with its near_bands-1 neighbours over the whole patch, embedded."""
        half = self.near_bands // 2
        wrapped = torch.cat([x[:, x.shape[1] - half :], x, x[:, :half]], dim=1) if half else x
        groups = wrapped.unfold(1, self.near_bands, 1)  # (n, bands, p, p, near_bands)
        return self.embed(groups.flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p)."""
        tokens = self.group_spectral_embedding(x)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        tokens = self.dropout(tokens + self.pos_embedding)
        layer_inputs = []
        for index, layer in enumerate(self.layers):
            layer_inputs.append(tokens)
            if index > 1:
                pair = torch.stack([tokens, layer_inputs[index - 2]], dim=-1)  # (n, tokens, dim, 2)
                tokens = self.skipcat[index - 2](pair).squeeze(-1)
            tokens = layer(tokens)
        return self.classifier(tokens[:, 0])
