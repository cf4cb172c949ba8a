"""What the pipeline search simulates and returns: best first, over values that grow more exact.

Every layout the search considers has, at any time, one value, at one of four levels:

1. STAGE: its stage layout's estimate in closed form (`backends.pipeline.estimate`: the cost
   model's per-op times summed, no simulation);
2. ESTIMATE: its own estimate from its stage layout's costed units (three small simulations,
   `backends.pipeline.units.unit_costs`; `backends.pipeline.candidates`);
3. TWO_REPLICAS: its step simulated exactly with two data-parallel replicas per stage;
4. EVERY_DEVICE: its step simulated on every device.

All of them wait in one queue. The lowest value is taken out and measured one level further
(a stage layout is costed and each of its candidates goes in; a candidate is simulated; a
two-replica step is simulated on every device), and goes back in with its new value. A
value that cannot be made more exact is final: a step on every device, or on two replicas
when the layout is too large to simulate on every device (or the two replicas are every
device already). The first final value taken out is the answer: every other value then in
the queue is at least its step, so the search never returns a layout worse than one it has
estimated, at any level, without having measured that one better, or found that it does
not fit. A layout is measured on every device before its step is trusted over another's
estimate.

This is the order of A* (Hart, Nilsson and Raphael 1968) with estimates in place of lower
bounds: it is cheap to go on when the estimates are close to the simulations, and they are
(docs/pipeline.md, "How a layout is scored"). Ties go in the order they came, so the search
is deterministic. A lowest value whose simulation on every device the time left is too
short for is set aside (the search goes on, limit TIME). The time limit or a Ctrl-C end it
early once something fits: the answer is then the best step of those measured as far as
they can be (a two-replica step not yet
simulated on every device is optimistic: on the 177B GPT of docs/pipeline.md one was 6.78 s
and 9.07 s on every device), or the best two-replica step when none is; a cap on the
layouts simulated (`exact`) stops new simulations but lets those simulated be measured on.
Late with no answer yet (a limit spent before the search began), it takes the shortest way to
one: no stage layout is costed while a costed candidate waits to be simulated.
Stage layouts the first ranking did not reach (its share of the time ran out) are estimated
before an answer is taken, as time allows.

Anytime: what no answer exists without (estimating stage layouts until one fits, costing
one) runs until `first`, the deadline plus a grace (the search's); a candidate is simulated
while no layout is only when its expected seconds (`expected`) fit in the time left (of the
grace, once late); once `due` has passed with nothing simulated, the best candidate costed
is simulated before any more stage layouts are costed, if it is expected to end in time; and
when the time runs out, or a Ctrl-C comes, before any layout is simulated, the answer is the
best candidate costed, its step from its estimate's units (`unsimulated`; ESTIMATE its
level), not a simulation.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from planner.deadline import Deadline, stop_requested

__all__ = ["ESTIMATE", "EVERY_DEVICE", "STAGE", "TWO_REPLICAS", "BestFirst", "Measure", "Tally"]

STAGE, ESTIMATE, TWO_REPLICAS, EVERY_DEVICE = range(4)
UNSIMULATED_TRIES = 8  # costed candidates looked at for an answer when none was simulated


class Measure(Protocol):
    """A layout simulated exactly: its step, at which level, and the layout."""

    @property
    def step(self) -> float: ...

    @property
    def level(self) -> int: ...

    @property
    def layout(self) -> Hashable: ...


@dataclass
class Tally:
    """What the selection found (`answer`; None: nothing fits) and how it went."""

    answer: Any = None
    estimated: int = 0  # stage layouts estimated in closed form after the first ranking
    within: int = 0  # of those, with a candidate within memory
    costed: int = 0  # stage layouts costed
    fit: int = 0  # candidates of those within memory
    simulated: int = 0  # candidates simulated exactly
    everywhere: int = 0  # of those, simulated again on every device
    least: float = float("inf")  # the least memory per device seen
    stopped: bool = False  # the time limit or a Ctrl-C ended it
    capped: bool = False  # the `exact` cap ended new simulations
    set_aside: int = 0  # candidates not simulated: expected to take longer than the time left


class BestFirst(ABC):
    """The queue and its rule (the module's docstring); the steps that measure a value one
    level further are the subclass's."""

    def __init__(
        self,
        deadline: Deadline,
        pending: list[Any],
        cap: int | None,
        tolerance: float = 0.0,
        first: Deadline | None = None,
        due: Deadline | None = None,
    ) -> None:
        self.deadline = deadline
        self.first = first or deadline  # what no answer exists without runs until then
        self.due = due  # past it with nothing simulated, the best costed is simulated first
        self.shrink = 1.0 / (1.0 + tolerance)  # a final within the gap tolerance is taken
        self.pending = pending  # stage layouts not estimated yet
        self.cap = cap
        self.tally = Tally()
        self.measured: dict[Hashable, Measure] = {}  # each layout's most exact measure
        self.settled: set[Hashable] = set()  # layouts measured as far as they can be
        self.cut: set[Hashable] = set()  # measured on two replicas only for want of time
        self._queue: list[tuple[float, int, int, bool, int, Any]] = []
        self._order = itertools.count()
        self.costed: list[tuple[float, int, Any]] = []  # every candidate queued, by value
        self.tried: set[Any] = set()  # candidates simulated (fitting or not)
        self._untried = 0  # costed candidates not simulated: an answer by estimate, if need be

    def push(self, value: float, level: int, item: Any, final: bool = False) -> None:
        """`item` at `level` with `value`: more exact first among equal values, then first come."""
        order = next(self._order)
        heapq.heappush(self._queue, (value, -level, order, final, level, item))
        if level == ESTIMATE:
            self.costed.append((value, order, item))
            self._untried += 1

    def late(self) -> bool:
        return self.deadline.expired() or stop_requested()

    def run(self) -> Tally:
        """The answer, by the rule of the module's docstring."""
        steps: dict[int, Callable[[Any], bool]] = {
            STAGE: self.cost,
            ESTIMATE: self.simulate,
            TWO_REPLICAS: self.everywhere,
        }
        tally = self.tally
        while self._queue or self.pending:
            final_next = bool(self._queue) and self._queue[0][3]
            if self.pending and (not self._queue or final_next) and self._rank_more():
                continue
            if not self._queue:
                break
            near = self._within_tolerance()
            if near is not None:
                return self._answer(near)
            value, _, _, final, level, item = heapq.heappop(self._queue)
            if level == ESTIMATE and item in self.tried:  # simulated out of turn (`_due`)
                continue
            due = self._due() if level == STAGE else None
            if due is not None:  # its simulation before more costings: it is time
                self.push(value, level, item)
                if not steps[ESTIMATE](due):
                    tally.stopped = True
                    break
                self.tried.add(due)
                self._untried -= 1
                continue
            if level == STAGE and self._untried and not self.measured and self.late():
                tally.stopped = True  # no answer yet, and late: the shortest way to one
                continue
            if final and item.layout in self.cut:  # optimistic, and no time to know better
                tally.stopped = True  # set aside: the answer is one measured as far as it can be
                continue
            if final:
                return self._answer(item)
            if self.measured and self.late():
                tally.stopped = True
                break
            if level in (STAGE, ESTIMATE) and self.cap is not None and tally.simulated >= self.cap:
                tally.capped = True  # the measured ones are still measured further
                continue
            if level == ESTIMATE and not self.measured and not self._in_time(item):
                tally.stopped = True  # its estimate stands for it if nothing is simulated
                tally.set_aside += 1
                continue
            if not steps[level](item):
                tally.stopped = True
                break
            if level == ESTIMATE and item not in self.tried:
                self.tried.add(item)
                self._untried -= 1
        if not self.measured:
            return self._unsimulated() if tally.stopped else tally
        # cut short: like with like, the best of those measured as far as they can be (a
        # two-replica step that has not been simulated on every device yet is optimistic)
        settled = [m for key, m in self.measured.items() if key in self.settled]
        return self._answer(
            min(settled or self.measured.values(), key=lambda r: (r.step, r.layout))
        )

    def _within_tolerance(self) -> Measure | None:
        """The best settled measure when no value still queued (nor a stage layout not yet
        estimated) could beat it by more than the gap tolerance, else None."""
        if self.shrink == 1.0 or self.pending or not self.settled:
            return None
        best = min(
            (self.measured[k] for k in self.settled if k in self.measured),
            key=lambda r: (r.step, r.layout),
            default=None,
        )
        if best is None or best.step * self.shrink > self._queue[0][0]:
            return None
        return best

    def _due(self) -> Any:
        """The best costed candidate, when nothing is simulated yet, `due` has passed and its
        simulation is expected to end in the time left (None otherwise): simulated before
        any more stage layouts are costed, so that the answer at the limit is a simulated
        one where one fits in the time."""
        if self.measured or not self._untried or self.due is None or not self.due.expired():
            return None
        if self.cap is not None and self.tally.simulated >= self.cap:  # `exact` counts it too
            return None
        best = min((c for c in self.costed if c[2] not in self.tried), default=None)
        if best is None or self.late() or not self._in_time(best[2]):
            return None
        return best[2]

    def _in_time(self, candidate: Any) -> bool:
        """Whether `candidate`'s simulation, the first, is expected to end in the time left:
        of the deadline, or once it has passed, of the grace for a first answer."""
        left = (self.first if self.late() else self.deadline).left()
        return self.expected(candidate) <= left

    def _unsimulated(self) -> Tally:
        """Cut short before any layout was simulated: the best candidate costed and not
        found unfit by a simulation, at its estimate (`unsimulated`), if one fits."""
        tried = 0
        for _, _, item in sorted(self.costed, key=lambda c: c[:2]):
            if item in self.tried:
                continue
            found = self.unsimulated(item)
            if found is not None:
                return self._answer(found)
            tried += 1
            if tried >= UNSIMULATED_TRIES:
                break
        return self.tally

    def _answer(self, best: Measure) -> Tally:
        self.tally.answer = best
        self.tally.stopped |= best.layout in self.cut  # with more time: on every device
        return self.tally

    def _rank_more(self) -> bool:
        """The next stage layouts not estimated yet, estimated and queued (True), unless the
        time is up and there is an answer, or a costed candidate (False: it is taken without
        them)."""
        if (self.measured or self._untried) and self.late():
            self.tally.stopped = True
            return False
        batch, self.pending = self.pending[: self.batch], self.pending[self.batch :]
        unreached = self.rank(batch, needed=not (self.measured or self._untried))
        self.pending = unreached + self.pending
        if len(unreached) == len(batch):  # no time left to estimate one, even for an answer
            self.tally.stopped = True
            return False
        return True

    batch = 64  # stage layouts estimated at a time once the first ranking's share is spent

    def keep(self, measure: Measure | None) -> None:
        """A simulation's result: queued by its step (final on every device), or nothing
        when it does not fit."""
        if measure is None:
            return
        self.measured[measure.layout] = measure
        if measure.level == EVERY_DEVICE:
            self.settle(measure)
        else:
            self.push(measure.step, measure.level, measure)

    def settle(self, measure: Measure, for_want_of_time: bool = False) -> None:
        """`measure` as exact as it can be (on every device, or on two replicas when it
        cannot be simulated on every device): queued final."""
        (self.cut if for_want_of_time else self.settled).add(measure.layout)
        self.push(measure.step, measure.level, measure, final=True)

    @abstractmethod
    def rank(self, batch: list[Any], needed: bool) -> list[Any]:
        """Estimate `batch` (all of it when `needed`, else until the deadline), queue each at
        STAGE, and return those not reached."""

    @abstractmethod
    def cost(self, key: Any) -> bool:
        """Cost a stage layout and queue its candidates at ESTIMATE (False: stopped)."""

    @abstractmethod
    def simulate(self, candidate: Any) -> bool:
        """Simulate a candidate exactly and `keep` it (False: stopped)."""

    def expected(self, candidate: Any) -> float:
        """Seconds `candidate`'s simulation is expected to take (0: unknown)."""
        return 0.0

    def unsimulated(self, candidate: Any) -> Measure | None:
        """`candidate` measured by its estimate only (None: no such measure, or it does not
        fit)."""
        return None

    @abstractmethod
    def everywhere(self, measure: Any) -> bool:
        """Simulate a two-replica measure on every device and `keep` it, or `settle` it,
        or drop it from `measured` when it does not fit there (False: stopped)."""
