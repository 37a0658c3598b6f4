"""A planted-fault family installed the way a user's family is: by entry point.

Subprocess runs of ``python -m conformance`` cannot see a family defined in a test, so
this writes a throwaway distribution whose ``conformance.families`` entry point
registers one; put its directory on ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path

FAULTY = "llama-rope-base"
"""The installed family: llama whose NNX side builds its rotary embedding with another base."""

FAMILY_MODULE = f'''
from tests.faults.forward import RopeBase


class LlamaRopeBase(RopeBase):
    """Planted fault: NNX builds its rotary embedding with another base."""

    name = "{FAULTY}"
'''
ENTRY_POINTS = f"[conformance.families]\n{FAULTY} = report_faults:LlamaRopeBase\n"


def install_faulty_family(site: Path) -> None:
    """Write the distribution registering :data:`FAULTY` into the directory ``site``."""
    (site / "report_faults.py").write_text(FAMILY_MODULE)
    info = site / "report_faults-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: report-faults\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
