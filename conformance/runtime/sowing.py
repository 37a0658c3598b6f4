"""Running an NNX model outside ``nnx.capture`` on purpose.

flax 0.12 deprecates ``Module.sow`` outside ``nnx.capture`` (the sown value is stored on
the model) and warns from the module's own ``sow`` line. The harness runs a model that way
on purpose where it runs it as a user or a library does: Qwix's quantization traces a plain
forward, and the state-hygiene check calls the model eagerly and under ``nnx.jit`` to see
what such calls leave behind. Each then removes what was sown. The warning would point at
the family's code for a call the harness made, so those calls silence it, and only it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

SOW_OUTSIDE_CAPTURE = r"Using 'Module\.sow\(\)' outside of 'nnx\.capture\(\)' is deprecated"


@contextlib.contextmanager
def outside_capture() -> Iterator[None]:
    """Within the block, flax's warning about sowing outside ``nnx.capture`` is not shown.

    Every other warning, flax's other deprecations included, is shown as before.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SOW_OUTSIDE_CAPTURE, DeprecationWarning)
        yield
