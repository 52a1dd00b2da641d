"""course.tiles: tile bounds like torch.tensor_split, pooling factors, and the difference picture."""
import copy

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import course  # noqa: E402
from course.tiles import downsampling_factor, plot_difference, split_bounds  # noqa: E402


@pytest.mark.parametrize("size,parts", [(10, 3), (7, 7), (67, 2), (93, 4), (5, 1)])
def test_split_bounds_are_the_pieces_of_tensor_split(size, parts):
    pieces = torch.arange(size).tensor_split(parts)
    assert split_bounds(size, parts) == [(int(p[0]), int(p[-1]) + 1) for p in pieces]


def test_split_bounds_refuses_empty_pieces():
    with pytest.raises(ValueError, match="cannot cut 3"):
        split_bounds(3, 4)


def test_downsampling_factor_multiplies_pool_strides():
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2), nn.ReLU(), nn.AvgPool2d(3), nn.MaxPool2d(2)]
    assert downsampling_factor(layers) == 12
    assert downsampling_factor([nn.Conv2d(3, 4, 3, padding=1)]) == 1


def test_haloed_tiles_on_emulated_gpus_equal_the_plain_pytorch_convolution():
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    image = torch.randn(1, 2, 11, 9)
    expected = conv(image)
    with course.emulate(gpus=3):
        rows = []
        for device, (top, bottom) in enumerate(split_bounds(11, 3)):
            lo, hi = max(0, top - 1), min(11, bottom + 1)
            out = copy.deepcopy(conv).to(f"cuda:{device}")(image[..., lo:hi, :].to(f"cuda:{device}"))
            rows.append(out[..., top - lo:bottom - lo, :].cpu())
    torch.testing.assert_close(torch.cat(rows, dim=2), expected)


def test_plot_difference_titles_the_largest_error():
    whole = torch.zeros(1, 2, 4, 4)
    tiled = whole.clone()
    tiled[0, 1, 2, 3] = 0.5
    figure = plot_difference(whole, tiled)
    assert figure.axes[0].get_title() == "largest error 0.5"
