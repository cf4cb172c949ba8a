"""Simulation: FlexFlow's execution simulator (full and delta) and its traces and Gantt charts."""
