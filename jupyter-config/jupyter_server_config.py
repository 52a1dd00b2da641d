"""JupyterLab as `make lab` (learners) and `make formgrader` (instructors) open it.

The Makefile puts this folder on JUPYTER_CONFIG_PATH, so these settings travel with the repository
instead of living in each user's ~/.jupyter, and a learner's own settings still win where they set any.
"""
import os

c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file

# Land on the course index, rendered: lab-settings/overrides.json opens Markdown as a preview. Relative
# to the folder the lab serves (notebooks/ for learners, the repository for instructors). The server
# prints this URL, with its real port and token, so the link it shows is the one to open.
c.LabApp.default_url = "/lab/tree/README.md"
# No news pop-up and no requests to jupyterlab.github.io: a learner's first screen is the index.
c.LabApp.news_url = None
# Default settings (overrides.json) shipped with the course, instead of the venv's share/jupyter/lab/settings.
c.LabApp.app_settings_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lab-settings")
