"""Report files for a conformance run: JSON, Markdown, HTML with plots, JUnit XML.

Every process of a run writes its part into the same directory and re-renders the
merged report from all parts there (:func:`~conformance.report.render.write`), so the
files always cover every process that has finished.
"""
