"""The checks: one module per area, each built on the comparison kernel alone.

:mod:`~conformance.checks.kernel` is what every check shares (shared parameters, train
steps, the comparison and its attribution); :mod:`~conformance.checks.registry` lists
every check with what it needs, and runs one by name on a
:class:`~conformance.runtime.case.Case`. A check module never imports another.
"""
