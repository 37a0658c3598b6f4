"""Linen/NNX conformance harness: check that a Flax model's two backends agree.

Packages, each built only on those before it: :mod:`~conformance.contract` (the Family
contract, discovery and validation; :mod:`~conformance.families` is its public face),
:mod:`~conformance.core` (paths, numerics, sharding, processes, scopes, measurements,
failures, seams), :mod:`~conformance.runtime` (cases and sides: building, placing,
training, decoding, checkpoints, quantization; diagnosis), :mod:`~conformance.checks`
(the comparison kernel, the checks by area and their registry),
:mod:`~conformance.pytest_plugin` (the pytest plugin), :mod:`~conformance.report` (report
files) and :mod:`~conformance.cli` (``python -m conformance`` and the converter).
"""
