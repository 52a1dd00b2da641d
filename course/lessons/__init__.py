"""Helpers the chapters use: exercises, widgets and plots of lesson-specific results, and the simulations behind
them (sharding, pipelines, rings, DDP timing, planning a job)."""
