"""Channel ViT with hierarchical cross-channel aggregation, split at explicit band-group boundaries.

Pipeline: fixed contiguous band groups (aligned to VIS / NIR / SWIR-1 / SWIR-2 when the wavelengths are known,
see band_groups.py) -> per-band tokens of s×s sub-patches (shared linear + band embedding) ->
within-group cross-attention, each group's query a learned vector plus a linear embedding of the group's spectrum
at that position (``encode_group``) -> cross-attention across the group
tokens (``aggregate``) -> transformer over the spatial tokens (``head``). A channel-group-parallel wrapper runs
``encode_group`` for its own groups, gathers the results and calls ``aggregate`` and ``head``; the model itself
knows nothing about ranks.
"""

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from hslite.errors import ModelError
from hslite.models.band_groups import spectral_band_groups


class QueryCrossAttention(nn.Module):
    """A query attends over a set of tokens (pre-norm), then a residual MLP; one output token per set."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int, dropout: float) -> None:
        super().__init__()
        self.norm_tokens = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, query: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """A (dim,) query shared by every set, or one (m, dim) per set, over tokens (m, k, dim) -> (m, dim)."""
        query = query.expand(tokens.shape[0], -1)[:, None, :]
        keys = self.norm_tokens(tokens)
        out = query + self.attention(query, keys, keys, need_weights=False)[0]
        out = out + self.mlp(self.norm_mlp(out))
        return out[:, 0]


class ChannelViT(nn.Module):
    """Per-band tokens, two-level (within group, across groups) cross-attention, then a ViT over space.

    The channel-wise tokenizer follows Bao et al. 2024, "Channel Vision Transformers: An Image Is Worth 1×16×16
    Words" (ICLR); the hierarchical aggregation follows Tsaris et al. 2025, "Distributed Cross-Channel Hierarchical
    Aggregation for Foundation Models" (D-CHAG, arXiv:2506.21411). ``subpatch`` 0 picks 3 (1 for patches under 3),
    giving 9 spatial tokens at patch 9 or 11; an 11-pixel patch is centre-cropped to 9 so sub-patches tile it.
    """

    BAND_GROUPS = True  # encode_group / aggregate / head: what channel groups and rotation split at
    SUMMARY = "channel ViT: per-band tokens, within- then across-group cross-attention, ViT over space"
    # FSDP units; partial_aggregation runs once per band group: as a unit it would be gathered G times a step
    FSDP_UNITS = ("final_aggregation", "encoder")
    PAPER = "Tsaris et al. 2025, Distributed Cross-Channel Hierarchical Aggregation for Foundation Models (D-CHAG)"
    SIZES = {
        "small": {"dim": 64, "depth": 2, "heads": 4, "mlp_ratio": 4, "num_groups": 4, "subpatch": 0, "dropout": 0.0},
        "large": {"dim": 256, "depth": 6, "heads": 8, "mlp_ratio": 4, "num_groups": 4, "subpatch": 0, "dropout": 0.1},
        # The widths and depths of ViT-B/16 and ViT-L/16 (Dosovitskiy et al. 2021), the sizes of the spectral
        # foundation models teams fine-tune: ~86 M and ~304 M parameters, where the multi-GPU question is real.
        "vit_b": {"dim": 768, "depth": 12, "heads": 12, "mlp_ratio": 4, "num_groups": 4, "subpatch": 0, "dropout": 0.1},
        "vit_l": {
            "dim": 1024,
            "depth": 24,
            "heads": 16,
            "mlp_ratio": 4,
            "num_groups": 4,
            "subpatch": 0,
            "dropout": 0.1,
        },
        # ViT-G/14's width, depth and heads (Zhai et al. 2022, "Scaling Vision Transformers"; its 8192-wide MLP as
        # 5 × 1664): ~1.9 B parameters, whose weights, gradients and AdamW state (~30 GB) fit no 24 GB card.
        "vit_giant": {
            "dim": 1664,
            "depth": 48,
            "heads": 16,
            "mlp_ratio": 5,
            "num_groups": 4,
            "subpatch": 0,
            "dropout": 0.1,
        },
        # ViT-e's width, depth and heads (Chen et al. 2023, PaLI; its 15360-wide MLP as 9 × 1792): ~4 B
        # parameters, whose weights, gradients and AdamW state (~63 GB) leave an 80 GB GPU too little for activations.
        "vit_e": {
            "dim": 1792,
            "depth": 56,
            "heads": 16,
            "mlp_ratio": 9,
            "num_groups": 4,
            "subpatch": 0,
            "dropout": 0.1,
        },
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
        mlp_ratio: int,
        num_groups: int,
        subpatch: int,
        dropout: float,
        wavelengths_nm: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= num_groups <= in_bands:
            raise ModelError(
                f"channel_vit: num_groups must be between 1 and the {in_bands} bands; got {num_groups}. "
                f"Pass num_groups={min(max(num_groups, 1), in_bands)} or fewer."
            )
        if dim % heads:
            raise ModelError(f"channel_vit: dim {dim} must be a multiple of heads {heads}; change one of them.")
        subpatch = subpatch or (3 if patch_size >= 3 else 1)
        if not 1 <= subpatch <= patch_size:
            raise ModelError(
                f"channel_vit: subpatch must be between 1 and patch_size {patch_size}; got {subpatch}. "
                "Pass subpatch=0 to pick one automatically."
            )
        self.band_groups = spectral_band_groups(wavelengths_nm, in_bands, num_groups)
        self.subpatch = subpatch
        self.tokens_per_side = patch_size // subpatch
        self.crop_start = (patch_size - self.tokens_per_side * subpatch) // 2
        num_spatial_tokens = self.tokens_per_side**2

        # What belongs to one band group is a parameter of its own: a group that channel-subset rotation leaves out
        # of a step then gets no gradient, so the optimiser leaves it (and its moments) alone that step.
        self.tokenizer = nn.Linear(subpatch * subpatch, dim)
        self.band_embeddings = nn.ParameterList(
            nn.Parameter(torch.randn(stop - start, dim) * 0.02) for start, stop in self.band_groups
        )
        self.group_queries = nn.ParameterList(nn.Parameter(torch.randn(dim) * 0.02) for _ in self.band_groups)
        # Each group's query starts from a linear embedding of the group's whole spectrum at that position (what a
        # ViT's patch embedding sees), so the cross-attention refines a spectral signature instead of pooling from a
        # fixed query: a convex mix of per-band tokens alone trailed an RBF-SVM on ~1,000 training pixels.
        self.group_spectra = nn.ModuleList(
            nn.Linear((stop - start) * subpatch * subpatch, dim) for start, stop in self.band_groups
        )
        self.partial_aggregation = QueryCrossAttention(dim, heads, mlp_ratio, dropout)
        self.group_embeddings = nn.ParameterList(nn.Parameter(torch.randn(dim) * 0.02) for _ in self.band_groups)
        self.final_query = nn.Parameter(torch.randn(dim) * 0.02)
        self.final_aggregation = QueryCrossAttention(dim, heads, mlp_ratio, dropout)

        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, num_spatial_tokens + 1, dim) * 0.02)
        self.dropout = nn.Dropout(dropout)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, mlp_ratio * dim, dropout, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def _subpatches(self, x_group: torch.Tensor) -> torch.Tensor:
        """(n, b_g, p, p) -> (n, b_g, L, s*s): each band's s×s sub-patch at each of the L spatial positions."""
        s, side, c = self.subpatch, self.tokens_per_side, self.crop_start
        n, bands = x_group.shape[:2]
        x = x_group[..., c : c + side * s, c : c + side * s]
        return x.reshape(n, bands, side, s, side, s).permute(0, 1, 2, 4, 3, 5).reshape(n, bands, side * side, s * s)

    def encode_group(self, x_group: torch.Tensor, group_index: int) -> torch.Tensor:
        """Tokenize one band group and aggregate its bands at each spatial position: (n, b_g, p, p) -> (n, L, dim)."""
        start, stop = self.band_groups[group_index]
        if x_group.shape[1] != stop - start:
            raise ModelError(
                f"channel_vit: group {group_index} holds bands {start}..{stop - 1} ({stop - start} bands) but got "
                f"{x_group.shape[1]}; pass x[:, {start}:{stop}]."
            )
        subpatches = self._subpatches(x_group)
        tokens = self.tokenizer(subpatches) + self.band_embeddings[group_index][:, None, :]  # (n, b_g, L, dim)
        n, bands, num_spatial, dim = tokens.shape
        per_position = tokens.transpose(1, 2).reshape(n * num_spatial, bands, dim)
        spectra = subpatches.transpose(1, 2).reshape(n * num_spatial, -1)
        query = self.group_queries[group_index] + self.group_spectra[group_index](spectra)
        return self.partial_aggregation(query, per_position).view(n, num_spatial, dim)

    def group_parameters(self, group_index: int) -> list[nn.Parameter]:
        """The parameters only group `group_index`'s encode_group uses (channel groups reduce them over its owners)."""
        return [
            self.band_embeddings[group_index],
            self.group_queries[group_index],
            *self.group_spectra[group_index].parameters(),
        ]

    def aggregate(self, group_tokens: torch.Tensor, group_indices: Sequence[int]) -> torch.Tensor:
        """Cross-attend over the given groups' tokens at each spatial position: (n, G_active, L, dim) -> (n, L, dim).

        Any subset of groups may be given (channel-subset rotation); ``group_indices`` says which, in order.
        """
        if len(group_indices) != group_tokens.shape[1]:
            raise ModelError(
                f"channel_vit: {group_tokens.shape[1]} group token sets but {len(group_indices)} group indices; "
                "pass one index per group in group_tokens."
            )
        embeddings = torch.stack([self.group_embeddings[int(index)] for index in group_indices])
        tokens = group_tokens + embeddings[None, :, None, :]
        n, groups, num_spatial, dim = tokens.shape
        per_position = tokens.transpose(1, 2).reshape(n * num_spatial, groups, dim)
        return self.final_aggregation(self.final_query, per_position).view(n, num_spatial, dim)

    def head(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run the transformer over the spatial tokens (n, L, dim) with a cls token -> logits (n, classes)."""
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        x = self.dropout(torch.cat([cls, tokens], dim=1) + self.pos_embedding)
        for layer in self.encoder:
            x = layer(x)
        return self.classifier(self.norm(x[:, 0]))

    def encode_groups(self, x: torch.Tensor, group_indices: Sequence[int]) -> torch.Tensor:
        """The given groups' tokens from patches (n, bands, p, p) with every band: (n, len(group_indices), L, dim)."""
        groups = self.band_groups
        return torch.stack([self.encode_group(x[:, groups[g][0] : groups[g][1]], g) for g in group_indices], dim=1)

    def forward(self, x: torch.Tensor, group_indices: Sequence[int] | None = None) -> torch.Tensor:
        """Logits (n, classes) from patches (n, bands, p, p): the given groups (default all) encoded and aggregated.

        Channel-subset rotation passes the step's active groups; evaluation uses them all.
        """
        indices = list(range(len(self.band_groups))) if group_indices is None else list(group_indices)
        return self.head(self.aggregate(self.encode_groups(x, indices), indices))
