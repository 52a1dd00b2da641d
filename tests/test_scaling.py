"""course.lessons.scaling: sweeps call the work once per (size, GPU count); speedups and plots read them."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course.lessons import scaling# noqa: E402


def _made_up_ms(size, num_gpus):
    return size / num_gpus + 10 * (num_gpus - 1)


def test_sweep_has_one_row_per_gpu_count_in_size_order():
    calls = []

    def timed(size, num_gpus):
        calls.append((size, num_gpus))
        return _made_up_ms(size, num_gpus)

    times = scaling.sweep(timed, [20, 40], [1, 2])
    assert times == {1: [20.0, 40.0], 2: [20.0, 30.0]}
    assert sorted(calls) == [(20, 1), (20, 2), (40, 1), (40, 2)]


def test_speedups_are_relative_to_one_gpu():
    speedups = scaling.speedups({1: [20.0, 40.0], 2: [20.0, 30.0]})
    assert speedups[1] == [1.0, 1.0]
    assert speedups[2] == pytest.approx([1.0, 4 / 3])


def test_plots_label_their_axes_and_skip_the_baseline_speedup():
    times = scaling.sweep(_made_up_ms, [10, 100, 1000], [1, 2, 4])
    ax = scaling.plot_times([10, 100, 1000], times, title="t")
    assert ax.get_xlabel() and "ms" in ax.get_ylabel() and len(ax.get_lines()) == 3
    ax = scaling.plot_speedups([10, 100, 1000], times)
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["2 GPUs", "4 GPUs", "as fast as 1 GPU"]
    plt.close("all")


def test_amdahl_speedup_is_one_over_serial_plus_parallel_share():
    assert scaling.amdahl_speedup(1.0, 4) == pytest.approx(4.0)
    assert scaling.amdahl_speedup(0.0, 8) == pytest.approx(1.0)
    assert scaling.amdahl_speedup(0.5, 2) == pytest.approx(4 / 3)  # time 0.5 + 0.25 of one GPU's
    assert scaling.amdahl_speedup(0.99, 10**9) == pytest.approx(100.0, rel=1e-6)  # the 1 / (1 - p) ceiling
