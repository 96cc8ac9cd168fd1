"""The image models of timm's published RTX 3090 training table, written here at their published shapes.

Used by `whatif_vs_published.py` to price each model on the RTX 3090 profile (nothing is trained). Shapes follow the
papers and timm's definitions as benchmarked in 2022 (attention as explicit matmuls and a softmax, as timm then ran
it): ViT (Dosovitskiy et al. 2021), ResNet (He et al. 2016, the v1.5 bottleneck with its stride on the 3x3),
MLP-Mixer (Tolstikhin et al. 2021), DenseNet-121 (Huang et al. 2017). 1,000 classes, 224x224 RGB input.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, d))


def mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = (
            nn.LayerNorm(dim),
            Attention(dim, heads),
            nn.LayerNorm(dim),
            mlp(dim, 4 * dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, patch: int, dim: int, depth: int, heads: int, image: int = 224, classes: int = 1000):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int):
        super().__init__()
        self.norm1, self.tokens = nn.LayerNorm(dim), mlp(tokens, token_hidden)
        self.norm2, self.channels = nn.LayerNorm(dim), mlp(dim, channel_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class Mixer(nn.Module):
    def __init__(self, patch: int = 16, dim: int = 768, depth: int = 12, image: int = 224, classes: int = 1000):
        super().__init__()
        tokens = (image // patch) ** 2
        self.embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[MixerBlock(tokens, dim, dim // 2, 4 * dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


def conv_bn(cin: int, cout: int, k: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]


class Residual(nn.Module):
    def __init__(self, cin: int, width: int, stride: int, bottleneck: bool):
        super().__init__()
        cout = 4 * width if bottleneck else width
        if bottleneck:
            layers = [*conv_bn(cin, width, 1), nn.ReLU(), *conv_bn(width, width, 3, stride), nn.ReLU(),
                      *conv_bn(width, cout, 1)]  # fmt: skip
        else:
            layers = [*conv_bn(cin, width, 3, stride), nn.ReLU(), *conv_bn(width, width, 3)]
        self.body = nn.Sequential(*layers)
        self.short = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.short(x))


def resnet(depths: tuple[int, ...], bottleneck: bool, classes: int = 1000) -> nn.Sequential:
    layers: list[nn.Module] = [*conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for stage, depth in enumerate(depths):
        width = 64 * 2**stage
        for i in range(depth):
            layers.append(Residual(cin, width, 2 if i == 0 and stage > 0 else 1, bottleneck))
            cin = 4 * width if bottleneck else width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(),
                                  nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


def densenet121(growth: int = 32, blocks: tuple[int, ...] = (6, 12, 24, 16), classes: int = 1000) -> nn.Sequential:
    layers: list[nn.Module] = [*conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for i, depth in enumerate(blocks):
        for _ in range(depth):
            layers.append(DenseLayer(channels, growth))
            channels += growth
        if i < len(blocks) - 1:
            layers += [nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels // 2, 1, bias=False),
                       nn.AvgPool2d(2, 2)]  # fmt: skip
            channels //= 2
    return nn.Sequential(*layers, nn.BatchNorm2d(channels), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, classes))  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {
    "vit_tiny_patch16_224": lambda: ViT(16, 192, 12, 3),
    "vit_small_patch16_224": lambda: ViT(16, 384, 12, 6),
    "vit_base_patch16_224": lambda: ViT(16, 768, 12, 12),
    "vit_base_patch32_224": lambda: ViT(32, 768, 12, 12),
    "vit_large_patch32_224": lambda: ViT(32, 1024, 24, 16),
    "resnet18": lambda: resnet((2, 2, 2, 2), bottleneck=False),
    "resnet50": lambda: resnet((3, 4, 6, 3), bottleneck=True),
    "resnet101": lambda: resnet((3, 4, 23, 3), bottleneck=True),
    "mixer_b16_224": lambda: Mixer(),
    "densenet121": lambda: densenet121(),
}
