"""Helpers for the multi-GPU PyTorch course: a GPU emulator with a simulated clock, and its plots."""
from course.ddp_timing import ddp_scaling, simulate_ddp_step
from course.emulator import Emulator, RealGPUs, emulate
from course.hardware import GPUS, LINKS
from course.plots import export_chrome_trace, plot_timeline, summary
from course.ranks import run_processes, run_threads

__all__ = ["emulate", "Emulator", "RealGPUs", "GPUS", "LINKS", "plot_timeline", "export_chrome_trace", "summary",
           "simulate_ddp_step", "ddp_scaling", "run_threads", "run_processes"]
