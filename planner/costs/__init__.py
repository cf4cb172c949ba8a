"""Configurations and costs: parallel configs and the config space, sub-tensor regions, the cost model (t_c, t_s, t_x, memory), per-task kernels and profiling."""
