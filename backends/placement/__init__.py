"""Device placement as a reduction (DLPlacer, Pal et al. 2019): the makespan objective turned
into a placement and scheduling problem that `ilp` and `cpsat` encode (no solver here).

- `problem`: the `PlacementProblem` (tasks, devices, routes, memory) and a list scheduler;
- `series`: the series decomposition of the solve and its lower bound.
"""
