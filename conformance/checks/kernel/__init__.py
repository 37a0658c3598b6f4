"""The comparison kernel every check is built on: sides, shared parameters, train steps.

A check compares two sides of a case (:mod:`conformance.runtime.sides`): it gives them
the same parameters (:func:`shared_params`), runs both, and compares what they computed,
keyed by canonical paths, under the tolerance policy. When a comparison on a mesh fails,
the same two computations on one device say which side moved (:func:`attributed`).
Check modules import this package's face and nothing else of ``conformance.checks``;
failures are raised with :func:`~conformance.core.failure.fail`, headed by the check
that runs. By what it compares:

* :mod:`~conformance.checks.kernel.logits`: forwards, quantized forwards, attribution;
* :mod:`~conformance.checks.kernel.layouts`: the parameter map, specs, placements,
  orbax round trips;
* :mod:`~conformance.checks.kernel.steps`: train steps;
* :mod:`~conformance.checks.kernel.parity`: train-step parity, and whether steps beyond
  the tolerance policy differ by rounding only;
* :mod:`~conformance.checks.kernel.checkpoints`: a train state restored strictly;
* :mod:`~conformance.checks.kernel.recorded`: a live side against a recorded reference;
* :mod:`~conformance.checks.kernel.variants`: a train step with a variant that must not
  change numerics (accumulation, a tiled loss) against the plain step;
* :mod:`~conformance.checks.kernel.precision`: the dtypes each module computes in;
* :mod:`~conformance.checks.kernel.activations`: how each module call's values are
  sharded.
"""

from conformance.checks.kernel.activations import (
    PROGRAMS,
    ActivationDifference,
    ConstraintDifference,
    Program,
    activation_differences,
    compare_tables,
    constraint_differences,
    golden_table,
    layout_rows,
    unanswered,
)
from conformance.checks.kernel.checkpoints import restored_into
from conformance.checks.kernel.layouts import (
    agreed_specs,
    leaf_table,
    misplaced,
    paired,
    round_trip,
    shared_params,
    structure_problems,
)
from conformance.checks.kernel.logits import (
    Rerun,
    attributed,
    attribution_text,
    beyond_own_spread,
    compared,
    error_bound,
    forward_attribution,
    nudged_reruns,
    quantized_forwards,
    within_spread,
)
from conformance.checks.kernel.parity import (
    rounding_step,
    spread_verdict,
    step_rounding,
    train_step_parity,
    twin_verdict,
)
from conformance.checks.kernel.precision import precision_differences
from conformance.checks.kernel.recorded import (
    against_title,
    beyond_spread_note,
    fail_against,
    partitioned_side,
    persistent_state,
    recorded_pair,
    recorded_params,
    recorded_step_parity,
    require_training,
    without_training,
)
from conformance.checks.kernel.steps import (
    DROPOUT_RATE,
    STEPS,
    judged_disagreement,
    leaf_group,
    rerun_note,
    step_disagreement,
    step_tree,
    steps_agree,
    train_pair,
    train_steps,
)
from conformance.checks.kernel.variants import variant_parity

__all__ = [
    "ActivationDifference",
    "ConstraintDifference",
    "DROPOUT_RATE",
    "PROGRAMS",
    "Program",
    "Rerun",
    "STEPS",
    "activation_differences",
    "against_title",
    "agreed_specs",
    "attributed",
    "attribution_text",
    "beyond_own_spread",
    "beyond_spread_note",
    "compare_tables",
    "compared",
    "constraint_differences",
    "error_bound",
    "fail_against",
    "forward_attribution",
    "golden_table",
    "judged_disagreement",
    "layout_rows",
    "leaf_group",
    "leaf_table",
    "misplaced",
    "nudged_reruns",
    "paired",
    "partitioned_side",
    "persistent_state",
    "precision_differences",
    "quantized_forwards",
    "recorded_pair",
    "recorded_params",
    "recorded_step_parity",
    "require_training",
    "rerun_note",
    "restored_into",
    "round_trip",
    "rounding_step",
    "shared_params",
    "spread_verdict",
    "step_disagreement",
    "step_rounding",
    "step_tree",
    "steps_agree",
    "structure_problems",
    "train_pair",
    "train_step_parity",
    "train_steps",
    "twin_verdict",
    "unanswered",
    "variant_parity",
    "within_spread",
    "without_training",
]
