"""Helpers for the multi-GPU PyTorch course: a GPU emulator with a simulated clock, and its plots."""
from course.emulator import Emulator, RealGPUs, emulate
from course.hardware import GPUS, LINKS
from course.plots import export_chrome_trace, plot_timeline, summary

__all__ = ["emulate", "Emulator", "RealGPUs", "GPUS", "LINKS", "plot_timeline", "export_chrome_trace", "summary"]
