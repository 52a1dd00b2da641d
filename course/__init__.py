"""Helpers for the multi-GPU PyTorch course: a GPU emulator with a simulated clock, and its plots."""
from course.cuda.emulator import Emulator, RealGPUs, emulate
from course.lessons.ddp_timing import ddp_scaling, simulate_ddp_step
from course.lessons.ranks import run_processes, run_threads
from course.machine.hardware import GPUS, LINKS
from course.machine.plots import export_chrome_trace, plot_timeline, summary

__all__ = ["emulate", "Emulator", "RealGPUs", "GPUS", "LINKS", "plot_timeline", "export_chrome_trace", "summary",
           "simulate_ddp_step", "ddp_scaling", "run_threads", "run_processes"]
