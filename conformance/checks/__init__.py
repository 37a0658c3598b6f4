"""The checks: one module per area, each built on the comparison kernel alone.

:mod:`~conformance.checks.kernel` is what every check shares (shared parameters, train
steps, the comparison and its attribution); each check declares what it needs on its
function (:func:`~conformance.checks.declare.declare`); :mod:`~conformance.checks.registry`
collects them, and runs one by name on a :class:`~conformance.runtime.case.Case`. A check
module never imports another.
"""
