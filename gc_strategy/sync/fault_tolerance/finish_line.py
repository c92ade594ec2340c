"""When fault-tolerant replica groups end their run: together (docs/fault_tolerance.md).

A group that ends as soon as it reaches its last step may leave the others without a peer: one
that comes back late then finds no live group to heal from, and trains alone from step 0 to another
end. :class:`FinishLine` ends each group at the first step from the planned number on that every
planned group took part in and committed (all then hold the same parameters, at the same step), or
``wait_s`` seconds after reaching it where a group does not come back.
"""

from __future__ import annotations

import time
import warnings


class FinishLine:
    """See the module's docstring: ``groups`` planned replica groups, ``wait_s`` the longest wait
    past the planned steps for a group that does not take part."""

    def __init__(self, groups: int, wait_s: float) -> None:
        self.groups, self.wait_s = groups, wait_s
        self._reached: float | None = None

    def crossed(self, step: int, steps: int, together: bool) -> bool:
        """Whether to end at ``step`` (the steps taken) of ``steps`` planned, where ``together``
        says that the last round committed with every planned group and nothing followed it."""
        if step < steps:
            return False
        if together:
            return True
        self._reached = self._reached or time.monotonic()
        waited = time.monotonic() - self._reached
        if waited <= self.wait_s:
            return False
        warnings.warn(
            f"fault_tolerance: ending at step {step} without every one of groups = {self.groups}: a group did not "
            f"take part within {self.wait_s:g} s (quorum_timeout_s) of the last planned step {steps}",
            RuntimeWarning,
            stacklevel=2,
        )
        return True
