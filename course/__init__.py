"""Helpers for the multi-GPU PyTorch course: a GPU emulator with a simulated clock, and its plots.

The package is in three layers, each importing only the ones below it (tests/test_layout.py checks it, and that
no import cycle hides in a function-local import):

- course/lessons: helpers the chapters use (exercises, widgets, sharding, pipelines, rings, DDP timing, planning);
- course/cuda: the layer that fakes CUDA on a CPU build of PyTorch: tensors on fake devices (devices, the bottom),
  the dispatcher that runs and times their ops (kernels), and what the emulator patches into torch;
- course/machine: the model of the hardware, with no torch patching: presets, costs, the simulated clock, its
  trace and plots, memory bookkeeping.

Above them, the package root holds only entry points: this public API, `python -m course` (__main__.py) and the
start-up hook that the installed course_emulate.pth names by module path (autostart.py).
"""
from course.cuda.emulator import Emulator, RealGPUs, emulate
from course.lessons.ddp_timing import ddp_scaling, simulate_ddp_step
from course.lessons.ranks import run_processes, run_threads
from course.machine.hardware import GPUS, LINKS
from course.machine.plots import export_chrome_trace, plot_timeline, summary

__all__ = ["emulate", "Emulator", "RealGPUs", "GPUS", "LINKS", "plot_timeline", "export_chrome_trace", "summary",
           "simulate_ddp_step", "ddp_scaling", "run_threads", "run_processes"]
