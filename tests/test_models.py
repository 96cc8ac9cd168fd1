import pytest
import torch

from hslite.errors import ModelError
from hslite.models import describe_models, get_model, has_band_groups, list_models

torch.set_num_threads(1)

MODELS = ["cnn1d", "cnn3d", "hybridsn", "spectralformer", "channel_vit", "ssftt"]
NUM_CLASSES = 5


def _patches(n, bands, patch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, bands, patch, patch, generator=generator)


def _param_count(model):
    return sum(p.numel() for p in model.parameters())


def test_registry_lists_every_model_with_a_paper():
    assert list_models() == MODELS
    descriptions = describe_models()
    assert set(descriptions) == set(MODELS)
    assert all(" et al. 20" in line for line in descriptions.values())


@pytest.mark.parametrize("size", ["small", pytest.param("large", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_and_finite_grads(name, size):
    torch.manual_seed(0)
    cases = [(bands, patch) for bands in (30, 103, 200) for patch in (9, 11)]
    if name == "hybridsn" and size == "small":
        cases.append((30, 25))  # the paper's input
    for bands, patch in cases:
        model = get_model(name, in_bands=bands, num_classes=NUM_CLASSES, patch_size=patch, size=size)
        logits = model(_patches(2, bands, patch))
        assert logits.shape == (2, NUM_CLASSES), (bands, patch)
        logits.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), (bands, patch)


@pytest.mark.parametrize("name", MODELS)
def test_large_is_bigger_than_small(name):
    for bands in (30, 103, 200):
        small, large = (
            _param_count(get_model(name, in_bands=bands, num_classes=NUM_CLASSES, patch_size=9, size=size))
            for size in ("small", "large")
        )
        ratio = 10 if name in ("spectralformer", "channel_vit") else 3
        assert large >= ratio * small, (bands, small, large)


def test_hybridsn_small_matches_paper_parameter_count():
    # Roy et al. report 5,122,176 trainable parameters for 25×25×30 inputs and 16 classes (Indian Pines).
    model = get_model("hybridsn", in_bands=30, num_classes=16, patch_size=25)
    assert _param_count(model) == 5_122_176


def test_cnn1d_reads_the_centre_pixel_and_with_window_mean_the_window_mean():
    for patch in (1, 9):  # the paper's model by default, whatever the patch: a run trained on it rebuilds it
        assert get_model("cnn1d", in_bands=50, num_classes=NUM_CLASSES, patch_size=patch).conv.in_channels == 1
    with pytest.raises(ModelError, match="patch_size 1 has no window; set data.patch_size to 3 or more"):
        get_model("cnn1d", in_bands=50, num_classes=NUM_CLASSES, patch_size=1, window_mean=True)
    model = get_model("cnn1d", in_bands=50, num_classes=NUM_CLASSES, patch_size=9, window_mean=True).eval()
    x = _patches(3, 50, 9)
    moved = x.clone()  # the same window mean: only where the off-centre values lie differs
    moved[:, :, 0, 0], moved[:, :, 8, 8] = x[:, :, 8, 8], x[:, :, 0, 0]
    raised = x.clone()
    raised[:, :, 0, 0] += 1.0
    centre = x.clone()
    centre[:, :, 4, 4] += 1.0
    with torch.no_grad():
        assert torch.allclose(model(x), model(moved), atol=1e-6)
        assert not torch.allclose(model(x), model(raised), atol=1e-4)
        assert not torch.allclose(model(x), model(centre), atol=1e-4)


def test_cnn3d_accepts_the_smallest_patch():
    model = get_model("cnn3d", in_bands=30, num_classes=NUM_CLASSES, patch_size=3)
    assert model(_patches(2, 30, 3)).shape == (2, NUM_CLASSES)


def test_unknown_model_lists_valid_names_and_closest():
    with pytest.raises(ModelError) as err:
        get_model("hybridSN", in_bands=30, num_classes=4, patch_size=9)
    message = str(err.value)
    assert all(name in message for name in MODELS)
    assert "Did you mean 'hybridsn'" in message


def test_unknown_size_lists_valid_sizes():
    with pytest.raises(ModelError, match="valid sizes are small, large"):
        get_model("cnn1d", in_bands=30, num_classes=4, patch_size=9, size="huge")


def test_unknown_kwargs_are_named_with_the_valid_ones():
    with pytest.raises(ModelError, match="Unknown option.*num_layers.*valid options are dim, depth"):
        get_model("channel_vit", in_bands=30, num_classes=4, patch_size=9, num_layers=3)


def test_kwargs_override_the_preset_and_are_type_checked():
    model = get_model("channel_vit", in_bands=30, num_classes=4, patch_size=9, num_groups=6)
    assert len(model.band_groups) == 6
    with pytest.raises(ModelError, match="num_groups='6'.*wrong type"):
        get_model("channel_vit", in_bands=30, num_classes=4, patch_size=9, num_groups="6")
    model = get_model("hybridsn", in_bands=30, num_classes=4, patch_size=9, hidden=[64, 32], dropout=0)
    assert model.classifier.in_features == 32
    with pytest.raises(ModelError, match="num_groups=True.*wrong type"):  # a bool is no count
        get_model("channel_vit", in_bands=30, num_classes=4, patch_size=9, num_groups=True)
    with pytest.raises(ModelError, match="window_mean=1.*wrong type.*pass a bool"):
        get_model("cnn1d", in_bands=30, num_classes=4, patch_size=9, window_mean=1)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("hybridsn", {"in_bands": 12, "patch_size": 25}, "at least 13 bands"),
        ("hybridsn", {"in_bands": 30, "patch_size": 7}, "patch_size >= 9"),
        ("cnn3d", {"in_bands": 30, "patch_size": 1}, "patch_size >= 3"),
        ("channel_vit", {"in_bands": 3, "patch_size": 9}, "num_groups must be between 1 and the 3 bands"),
        ("cnn1d", {"in_bands": 30, "patch_size": 8}, "patch_size must be odd"),
        ("cnn1d", {"in_bands": 0, "patch_size": 9}, "in_bands must be an integer of at least 1"),
    ],
)
def test_sizes_that_do_not_fit_say_what_to_change(name, kwargs, match):
    with pytest.raises(ModelError, match=match):
        get_model(name, num_classes=4, **kwargs)


def _channel_vit(bands=30, patch=9, **kwargs):
    torch.manual_seed(0)
    return get_model("channel_vit", in_bands=bands, num_classes=NUM_CLASSES, patch_size=patch, **kwargs).eval()


def test_channel_vit_forward_is_the_group_by_group_composition():
    model = _channel_vit()
    x = _patches(3, 30, 9)
    with torch.no_grad():
        tokens = [model.encode_group(x[:, start:stop], g) for g, (start, stop) in enumerate(model.band_groups)]
        stacked = torch.stack(tokens, dim=1)
        composed = model.head(model.aggregate(stacked, torch.arange(len(tokens))))
        assert stacked.shape == (3, 4, 9, 64)
        assert torch.equal(model(x), composed)


def test_channel_vit_forward_over_a_subset_encodes_only_those_groups():
    model = _channel_vit()
    x = _patches(3, 30, 9)
    with torch.no_grad():
        assert model.encode_groups(x, [1, 3]).shape == (3, 2, 9, 64)
        expected = model.head(model.aggregate(model.encode_groups(x, [1, 3]), [1, 3]))
        assert torch.equal(model(x, [1, 3]), expected) and torch.equal(model(x, None), model(x))


def test_channel_vit_aligns_its_groups_to_spectral_regions_and_says_it_has_groups():
    wavelengths = [450, 550, 650, 750, 850, 950, 1050, 1150, 1500, 1600, 2000, 2100]  # 3 VIS, 5 NIR, 2 + 2 SWIR
    model = get_model("channel_vit", in_bands=12, num_classes=3, patch_size=3, wavelengths_nm=wavelengths)
    assert model.band_groups == [(0, 3), (3, 8), (8, 10), (10, 12)]
    assert has_band_groups("channel_vit") and not any(has_band_groups(n) for n in ("cnn1d", "cnn3d", "hybridsn"))
    assert get_model("cnn3d", in_bands=12, num_classes=3, patch_size=3, wavelengths_nm=wavelengths) is not None


def test_channel_vit_aggregates_a_subset_of_groups():
    model = _channel_vit()
    x = _patches(3, 30, 9)
    with torch.no_grad():
        tokens = torch.stack([model.encode_group(x[:, a:b], g) for g, (a, b) in enumerate(model.band_groups)], dim=1)
        all_groups = model.aggregate(tokens, [0, 1, 2, 3])
        subset = model.aggregate(tokens[:, [1, 3]], [1, 3])
    assert subset.shape == all_groups.shape == (3, 9, 64)
    assert not torch.allclose(subset, all_groups)


def test_channel_vit_group_encoding_reads_only_its_bands():
    model = _channel_vit(bands=103, patch=11)
    x = _patches(2, 103, 11)
    g = 2
    start, stop = model.band_groups[g]
    perturbed = x + 5.0
    perturbed[:, start:stop] = x[:, start:stop]
    with torch.no_grad():
        assert torch.equal(model.encode_group(x[:, start:stop], g), model.encode_group(perturbed[:, start:stop], g))
        assert not torch.equal(model(x), model(perturbed))
    with pytest.raises(ModelError, match="pass x\\[:, 52:78\\]"):
        model.encode_group(x[:, :10], g)


def test_channel_vit_band_groups_are_contiguous_and_cover_all_bands():
    for bands, groups in [(30, 4), (103, 4), (200, 8), (5, 5)]:
        band_groups = _channel_vit(bands=bands, num_groups=groups).band_groups
        assert band_groups[0][0] == 0 and band_groups[-1][1] == bands
        assert all(a[1] == b[0] for a, b in zip(band_groups, band_groups[1:], strict=False))
        sizes = [b - a for a, b in band_groups]
        assert max(sizes) - min(sizes) <= 1


def _toy_batch(bands, patch, seed=0):
    """64 samples of 4 classes, each a class spectrum plus small noise: linearly separable."""
    generator = torch.Generator().manual_seed(seed)
    class_spectra = torch.randn(4, bands, generator=generator)
    labels = torch.arange(64) % 4
    noise = 0.3 * torch.randn(64, bands, patch, patch, generator=generator)
    return class_spectra[labels][:, :, None, None] + noise, labels


@pytest.mark.parametrize(("name", "lr"), [("cnn1d", 1e-2), pytest.param("channel_vit", 1e-3, marks=pytest.mark.slow)])
def test_small_models_overfit_a_toy_batch(name, lr):
    torch.manual_seed(0)
    x, labels = _toy_batch(bands=30, patch=9)
    model = get_model(name, in_bands=30, num_classes=4, patch_size=9)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(60):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), labels).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == labels).float().mean().item()
    assert accuracy > 0.9


@pytest.mark.parametrize(
    ("size", "encoder_millions"), [("vit_b", 85.0), ("vit_l", 302.2), ("vit_giant", 1861.8), ("vit_e", 3958.1)]
)
def test_channel_vit_has_foundation_model_presets_from_vit_b_to_vit_e_size(size, encoder_millions):
    with torch.device("meta"):  # sizes only: nothing allocated
        model = get_model("channel_vit", in_bands=200, num_classes=16, patch_size=9, size=size)
    # ViT-B/16's and ViT-L/16's transformer (Dosovitskiy et al.: 86 M and 307 M with their patch embedding and head),
    # ViT-G/14's (1.84 B with its 8192-wide MLP, here 5 × 1664) and ViT-e's (3.9 B), plus the two cross-attention
    # blocks that pool bands into groups and groups into positions
    assert _param_count(model.encoder) == pytest.approx(encoder_millions * 1e6, rel=0.005)
    assert _param_count(model) < 1.2 * _param_count(model.encoder)
