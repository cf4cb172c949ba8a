"""Graphs: the OpGraph, op kinds and their parallelizable dimensions, torch.fx capture, coarsening and the model zoo."""
