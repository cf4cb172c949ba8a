"""`python -m backends.warm`: compile every numba kernel once, before any time limit runs.

numba compiles a kernel at its first call and keeps the machine code in numba's cache beside
its source (`cache=True`). A cold compile of the `local` kernels takes one to two minutes
(80 s measured cold at load 1.3-4 on 2 cores; the `toulbar2` kernels and the cost-table
reader's loop a few seconds more), and a search's time limit counts it: in a fresh checkout,
the first `local` search shorter than that answers NO_SOLUTION ("out of time while
compiling"). `make install` runs this
module once, so the first search of a fresh checkout loads the cache (under a second)
instead. Running it again only loads the cache.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from planner.problems.problem import Problem

__all__ = ["warm"]


def warm() -> dict[str, float]:
    """Compile (or load) each family's kernels; the seconds each took."""
    from backends.local.anneal import compile_kernels
    from planner.problems.costtable import compiled_integers, contest_problem

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    compile_kernels()
    seconds["local"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _wcsp(contest_problem(60, seed=0))
    seconds["toulbar2"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    scan = compiled_integers()
    if scan is not None:
        text = np.frombuffer(b"[[1, 2], [3]]", dtype=np.uint8)
        scan(text, np.zeros(3), np.zeros(2, dtype=np.int64))
    seconds["reader"] = time.perf_counter() - t0
    return seconds


def _wcsp(problem: Problem) -> None:
    """Each kernel `toulbar2` calls, once, on a small problem's network: TRW-S's passes, bound
    and decoding (one step of the Lagrangian), then the mending, repair and polish moves, and
    the crossovers (4-5 s of compiling otherwise in a first contest run's first round)."""
    from backends.wcsp import trws
    from backends.wcsp.bound import Lagrangian
    from backends.wcsp.crossover import crossover, crossover_repaired
    from backends.wcsp.memory import kernel_arrays, polish, profile, repair, steps, unbreak
    from backends.wcsp.network import build_network
    from planner.deadline import Deadline

    net = build_network(problem)
    st = steps(problem)
    assert st is not None  # a contest problem has a memory limit
    lagrange = Lagrangian(net, st)
    _, x = lagrange.step(None)
    inc = trws.incidence(net.noff, net.eu, net.ev)
    g = kernel_arrays(net.noff, net.unary, net.eu, net.ev, net.eoff, net.binary, inc)
    x = x.astype(np.int64).copy()
    donor = x.copy()
    unbreak(x, g, 10)
    prof = profile(st, net.usage[net.noff[:-1] + x], st.count)
    repair(x, prof, st.first, st.after, st.limit, net.usage, g, 10, 10)
    polish(x, prof, st.first, st.after, st.limit, net.usage, g)
    crossover(x, donor, prof, st.first, st.after, st.limit, net.usage, g)
    crossover_repaired(x, donor, prof, st, net.usage, g, 1, Deadline.after(5.0))


def main() -> int:
    t0 = time.perf_counter()
    print("compiling the numba kernels (a minute or two the first time) ...", flush=True)
    seconds = warm()
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    print(f"kernels ready in {time.perf_counter() - t0:.1f} s ({parts})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
