"""Sphinx configuration: MyST Markdown pages, tables generated from the code."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "linen-nnx-conformance"
copyright = "the linen-nnx-conformance authors"
extensions = ["myst_parser", "conformance_tables"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
myst_heading_anchors = 3
# Option names and quoted values stay as written (no en dashes, no curly quotes).
smartquotes = False
html_theme = "alabaster"
html_title = project
