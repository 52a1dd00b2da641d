"""The model of the hardware, with no torch patching: GPU and link presets, what work costs, the simulated clock and
its trace, memory bookkeeping, and the plots that draw a trace."""
