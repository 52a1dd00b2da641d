"""What-if controls for notebooks: sliders and menus that redraw a figure in place.

The figure for the default values is drawn as an ordinary output first, so a notebook run without a
browser (nbval, nbgrader, CI) still shows it; in JupyterLab moving a control replaces it. If `draw`
raises for the values chosen, the figure is replaced by the error (with the values that caused it), so the
cell never shows a stale figure under controls that say something else.
"""
from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import HTML, display


def _error_message(error: BaseException, values: dict) -> HTML:
    """What a failed redraw shows in place of the figure: the values, and the error as Python names it."""
    chosen = ", ".join(f"{name}={value!r}" for name, value in values.items())
    text = f"Could not draw for {chosen}:\n{type(error).__name__}: {error}"
    return HTML(f'<pre style="color: #b00020; white-space: pre-wrap">{html.escape(text)}</pre>')


def what_if(draw, **controls):
    """Display `controls` (ipywidgets, by keyword) and the figure `draw(**values)` returns, kept in sync.

    `draw` must return a matplotlib Figure. The default figure is drawn at once (an error there is raised, as
    in any cell); an error while redrawing for new values is shown in the cell instead of the figure. Offer
    only values `draw` accepts (e.g. `SelectionSlider(options=...)`). Returns the box of controls, so a test
    can set their values.
    """
    def values():
        return {name: control.value for name, control in controls.items()}

    box = widgets.HBox(list(controls.values()))
    display(box)
    figure = draw(**values())
    handle = display(figure, display_id=True)
    plt.close(figure)

    def redraw(_change):
        chosen, before = values(), set(plt.get_fignums())
        try:
            new_figure = draw(**chosen)
        except Exception as error:  # shown in the cell: an observer's exception only reaches the browser's log
            for number in set(plt.get_fignums()) - before:  # a half-drawn figure
                plt.close(number)
            handle.update(_error_message(error, chosen))
            return
        handle.update(new_figure)
        plt.close(new_figure)

    for control in controls.values():
        control.observe(redraw, names="value")
    return box
