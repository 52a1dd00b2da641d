"""course.lessons.tiles: tile bounds like torch.tensor_split, pooling factors, and the difference picture."""
import copy

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import course  # noqa: E402
from course.lessons.tiles import downsampling_factor, plot_difference, split_bounds  # noqa: E402


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


def test_tile_box_is_row_major_and_refuses_a_tile_outside_the_grid():
    from course.lessons.tiles import tile_box

    assert [tile_box(5, 7, (2, 3), i) for i in (0, 2, 3)] == [(0, 3, 0, 3), (0, 3, 5, 7), (3, 5, 0, 3)]
    with pytest.raises(ValueError, match="tiles 0 to 5"):
        tile_box(5, 7, (2, 3), 6)


def test_forward_with_exchange_equals_the_whole_image_when_the_halo_is_exact():
    import torch.nn.functional as F

    from course.lessons.tiles import forward_with_exchange

    torch.manual_seed(1)
    layers = nn.Sequential(nn.Conv2d(2, 3, 5, padding=2), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=2, dilation=2))
    image = torch.randn(1, 2, 10, 12)
    seen = []

    def whole_image_exchange(tile, grid, width):  # one tile covering the image: the halo is the zero padding
        seen.append(width)
        return F.pad(tile, (width,) * 4)

    out = forward_with_exchange(layers, image, (1, 1), whole_image_exchange)
    assert seen == [2, 2]
    torch.testing.assert_close(out, layers(image))
    with pytest.raises(ValueError, match="stride 1"):
        forward_with_exchange([nn.Conv2d(2, 2, 3, stride=2, padding=1)], image, (1, 1), whole_image_exchange)


def test_halo_exchange_on_rank_threads_equals_the_padded_image_and_sends_to_neighbours_only():
    import sys
    from pathlib import Path

    import torch.nn.functional as F

    from course.lessons.halo_ranks import exchange_on_ranks, tiled_forward_on_ranks
    from course.lessons.tiles import tile_box

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "autograder"))
    from references.tiled_parallelism import exchange_halo

    image = torch.randn(2, 3, 9, 10)
    padded, devices, sent = exchange_on_ranks(exchange_halo, image, (3, 2), 2)
    whole = F.pad(image, (2,) * 4)
    for rank, tile in enumerate(padded):
        top, bottom, left, right = tile_box(9, 10, (3, 2), rank)
        torch.testing.assert_close(tile, whole[..., top:bottom + 4, left:right + 4])
    assert devices == [f"cuda:{r}" for r in range(6)]
    assert sent and all(abs(s // 2 - d // 2) + abs(s % 2 - d % 2) == 1 for s, d, _ in sent)

    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3, padding=1))
    picture = torch.randn(1, 3, 16, 16)
    expected = model(picture).detach()
    runs = [tiled_forward_on_ranks(model, picture, (2, 2), halo=4),
            tiled_forward_on_ranks(model, picture, (2, 2), exchange=exchange_halo)]
    for run in runs:
        stitched = torch.cat([torch.cat(run.outputs[:2], dim=3), torch.cat(run.outputs[2:], dim=3)], dim=2)
        torch.testing.assert_close(stitched, expected)
    recompute, exchange = runs
    assert exchange.host_bytes == picture.numel() * 4 < recompute.host_bytes
    assert recompute.bytes_between_gpus == 0 < exchange.bytes_between_gpus
    again = tiled_forward_on_ranks(model, picture, (2, 2), exchange=exchange_halo)
    assert again.elapsed_ms == exchange.elapsed_ms  # simulated time is the same on every run
    with pytest.raises(ValueError, match="either halo"):
        tiled_forward_on_ranks(model, picture, (2, 2))
    with pytest.raises(ValueError, match="pooling factor 2"):
        tiled_forward_on_ranks(model, torch.randn(1, 3, 14, 16), (2, 2), halo=4)


def test_data_parallel_forward_traces_the_four_phases_the_same_on_every_run():
    from course.lessons.data_parallel_trace import data_parallel_forward

    events = data_parallel_forward(1000, [64, 128, 32], 3, "pcie4")
    assert {e.name for e in events if e.kind == "collective"} == {"nccl:broadcast"}
    copies = {e.name for e in events if e.kind == "copy"}
    assert {"copy cuda:0->cuda:1", "copy cuda:0->cuda:2", "copy cuda:1->cuda:0", "copy cuda:2->cuda:0"} <= copies
    assert {e.device for e in events if e.kind == "kernel"} == {"cuda:0", "cuda:1", "cuda:2"}
    assert events == data_parallel_forward(1000, [64, 128, 32], 3, "pcie4")
    with pytest.raises(ValueError, match="at least two widths"):
        data_parallel_forward(10, [64], 2)
