"""Helpers for the multi-GPU PyTorch course: a GPU emulator with a simulated clock, and its plots."""
from course.emulator import Emulator, RealGPUs, emulate
from course.hardware import GPUS, LINKS

__all__ = ["emulate", "Emulator", "RealGPUs", "GPUS", "LINKS"]
