"""Linen/NNX conformance harness: check that a Flax model's two backends agree.

Modules: :mod:`~conformance.families` (the Family contract and registry),
:mod:`~conformance.core.trees` (paths and structure), :mod:`~conformance.core.sharding` (meshes and
logical axes), :mod:`~conformance.core.numerics` (tolerances and comparison),
:mod:`~conformance.runtime.backends` (building and running each side),
:mod:`~conformance.checks` (the checks), :mod:`~conformance.core.goldens` (golden files),
:mod:`~conformance.core.scope` (how long compiled programs live), :mod:`~conformance.tiers`
(how much of the suite a run covers) and :mod:`~conformance.plugin` (the pytest plugin).
"""
