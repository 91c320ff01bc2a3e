"""The order in which one worker's running sequences are preempted (room.py takes victims in it),
and the per-class running lists it reads."""
from __future__ import annotations

from bisect import insort
from itertools import filterfalse
from operator import attrgetter

from services.common.priority import ORDER
from services.scheduler.request import Request

_COMPUTED, _SEQ_ID = attrgetter("computed"), attrgetter("seq_id")


def add_running(running_by_class: dict[int, list[Request]], request: Request) -> None:
    """Put a sequence admitted to a worker on its class's list there, which is kept in seq_id
    order: VictimOrder reads it newest first."""
    insort(running_by_class[request.priority], request, key=_SEQ_ID)


class VictimOrder:
    """One worker's running sequences in preemption order: lowest class first; inside a class,
    the sequence that loses the least work (the fewest tokens in its KV cache, all of which are
    computed again when it resumes; with prefix caching, the fewest past its named blocks, which
    stay cached for its return unless evicted), newest first among equals.

    Sorted a class at a time, as far as a caller needs: an admitted High that displaces a Low, the
    common case, sorts only the Low ones. Made once per plan (StepBuilder.victims): the order does
    not change while planning, and callers skip those preempted or scheduled meanwhile. A class
    sorted later in the plan also holds sequences admitted since (scheduled, so skipped as well)."""

    def __init__(self, running_by_class: dict[int, list[Request]], work_lost=None):
        self._running_by_class = running_by_class
        self._work_lost = work_lost or _COMPUTED      # with prefix caching: what it computes again
        self._unsorted = sorted(ORDER, reverse=True)      # lowest class (largest value) first
        self._order: list[Request] = []

    def down_to(self, scheduled: set[Request], priority: int, inclusive: bool = True) -> list[Request]:
        """The order through the classes below `priority` (and `priority` itself if inclusive),
        leaving out those in `scheduled` (the step's so far) when their class is sorted: never victims
        this step.
        The list only grows: an index into it stays valid for the rest of the plan."""
        unsorted = self._unsorted
        while unsorted and (unsorted[0] > priority or (inclusive and unsorted[0] == priority)):
            cls = unsorted.pop(0)
            # The class's own list (add_running), newest first, filtered at C level, and one stable
            # sort by the work each would lose, on a C-level key: this runs in the plans that
            # preempt, which make the plans' tail (bench/scheduler_overhead.py); a pass over every
            # running sequence of the worker, and a second sort for the ties, cost half of it.
            newest_first = reversed(self._running_by_class[cls])
            unscheduled = filterfalse(scheduled.__contains__, newest_first)
            self._order += sorted(unscheduled, key=self._work_lost)
        return self._order
