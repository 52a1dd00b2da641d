"""What-if controls for notebooks: sliders and menus that redraw a figure in place.

The figure for the default values is drawn as an ordinary output first, so a notebook run without a
browser (nbval, nbgrader, CI) still shows it; in JupyterLab moving a control replaces it.
"""
from __future__ import annotations

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display


def what_if(draw, **controls):
    """Display `controls` (ipywidgets, by keyword) and the figure `draw(**values)` returns, kept in sync.

    `draw` must return a matplotlib Figure. Returns the box of controls, so a test can set their values.
    """
    def values():
        return {name: control.value for name, control in controls.items()}

    box = widgets.HBox(list(controls.values()))
    display(box)
    figure = draw(**values())
    handle = display(figure, display_id=True)
    plt.close(figure)

    def redraw(_change):
        new_figure = draw(**values())
        handle.update(new_figure)
        plt.close(new_figure)

    for control in controls.values():
        control.observe(redraw, names="value")
    return box
