"""The notebook helpers: what-if widgets redraw in place; gpu_time_ms times with events."""
import ipywidgets as widgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import course  # noqa: E402
from course.lessons.timing import gpu_time_ms  # noqa: E402
from course.lessons.widgets import what_if  # noqa: E402


def test_what_if_draws_the_default_and_redraws_on_change(monkeypatch):
    shown = []
    monkeypatch.setattr("course.lessons.widgets.display", lambda obj, display_id=False: shown.append(obj) or _Handle(shown))
    drawn = []

    def draw(size):
        drawn.append(size)
        figure, axes = plt.subplots()
        axes.plot([0, size])
        return figure

    box = what_if(draw, size=widgets.IntSlider(value=3, min=1, max=10))
    assert drawn == [3]
    box.children[0].value = 7
    assert drawn == [3, 7]
    assert isinstance(shown[-1], matplotlib.figure.Figure)


class _Handle:
    def __init__(self, shown):
        self.shown = shown

    def update(self, obj):
        self.shown.append(obj)


def test_gpu_time_ms_equals_the_kernel_duration():
    with course.emulate(gpus=1) as emu:
        a = torch.randn(2048, 2048, device="cuda:0")
        ms, result = gpu_time_ms(torch.matmul, a, a)
        kernel = [e for e in emu.trace if e.name == "aten::mm"][0]
    assert result.shape == (2048, 2048)
    assert ms * 1e6 >= kernel.duration_ns
    assert ms * 1e6 <= kernel.duration_ns + 2 * course.machine.costs.HOST_LAUNCH_NS


def test_what_if_shows_an_error_in_a_redraw_instead_of_a_stale_figure(monkeypatch):
    shown = []
    monkeypatch.setattr("course.lessons.widgets.display", lambda obj, display_id=False: shown.append(obj) or _Handle(shown))

    def draw(size):
        if size > 5:
            plt.figure()  # half drawn, then fails
            raise ValueError(f"size {size} is too large")
        figure, axes = plt.subplots()
        axes.plot([0, size])
        return figure

    open_before = len(plt.get_fignums())
    box = what_if(draw, size=widgets.IntSlider(value=3, min=1, max=10))
    box.children[0].value = 7
    message = shown[-1]
    assert not isinstance(message, matplotlib.figure.Figure)
    assert "size=7" in message.data and "ValueError: size 7 is too large" in message.data
    assert len(plt.get_fignums()) == open_before
    box.children[0].value = 4
    assert isinstance(shown[-1], matplotlib.figure.Figure)
