"""The constraints files a make target installs together pin each shared package alike.

pip refuses two constraints that pin one package at two versions ("ResolutionImpossible"),
so a venv built from such a pair cannot be set up on a fresh machine: `make
setup-maxtext-tpu` combined MaxText's pins with the `tpu` extra's, which disagreed on
certifi and charset-normalizer.
"""

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT = sorted(p.name for p in ROOT.glob("constraints-maxtext-*.txt"))
TOGETHER = [
    ("constraints.txt", "constraints-docs.txt"),
    ("constraints.txt", "constraints-tpu.txt"),
    *(("constraints.txt", "constraints-tpu.txt", m) for m in MAXTEXT),
]
"""What the Makefile's venvs install together (``-c`` each): docs, tpu, MaxText with tpu."""


def _pins(name: str) -> dict[str, str]:
    """``{normalised package name: version}`` of one constraints file."""
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            package, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", package).lower()] = version
    return pins


def test_every_maxtext_release_has_a_constraints_file():
    assert MAXTEXT, "no constraints-maxtext-<release>.txt"


@pytest.mark.parametrize("files", TOGETHER, ids="+".join)
def test_constraints_installed_together_agree(files):
    pins = {name: _pins(name) for name in files}
    clashes = [
        f"{package}: {a}=={pins[a][package]} but {b}=={pins[b][package]}"
        for a, b in itertools.combinations(files, 2)
        for package in sorted(pins[a].keys() & pins[b].keys())
        if pins[a][package] != pins[b][package]
    ]
    assert not clashes, "\n".join(clashes)
