"""Write the checks and options tables from the registry and the option table.

Sphinx calls :func:`setup`; on ``builder-inited`` the tables are written to
``_generated/`` and the pages include them, so they cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from conformance.checks.registry import BUILTIN, Check
from conformance.cli.run import emulation_parser
from conformance.contract import Feature, spelling
from conformance.contract import features as typed
from conformance.contract.declared import FIRST_EDITION
from conformance.pytest_plugin.options import INI, OPTIONS

_ROLE = re.compile(r":(?:[a-z]+:)+`~?(?:[^`<]*<)?([^`>]+)>?`")
"""A Sphinx role (``:func:`~a.b` ``, ``:py:meth:`title <a.b>` ``): its target's last part."""

_CODE = re.compile(r"(`[^`]*`)")

FEATURES = [
    kind
    for kind in vars(typed).values()
    if isinstance(kind, type) and issubclass(kind, Feature) and kind is not Feature
]
"""Every typed feature, in the order :mod:`conformance.contract.features` defines them."""


def _plain(text: str) -> str:
    """Markdown-escape text outside code spans: emphasis and raw HTML stay literal."""
    for char in "\\*_<":
        text = text.replace(char, "\\" + char)
    return text


def _cell(text: str) -> str:
    """``text`` fit for one cell of a Markdown table: one line, roles as code, no pipes.

    Escapes apply outside code spans only (CommonMark reads none inside them); a pipe is
    escaped everywhere, as GitHub-flavoured tables require.
    """
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = " ".join(text.replace("``", "`").split())
    parts = _CODE.split(text)
    text = "".join(part if part.startswith("`") else _plain(part) for part in parts)
    return text.replace("|", "\\|")


def _summary(check: Check) -> str:
    """The first paragraph of the check function's docstring."""
    doc = inspect.getdoc(check.run) or ""
    return _cell(doc.split("\n\n", 1)[0])


def _over(check: Check) -> str:
    axes = [axis for axis in check.axes if axis != "family"]
    axes += [name for name, _ in check.params]
    over = [f"`{axis}`" for axis in axes]
    if check.variant:
        over = [
            f"{axis} (`default`: the primary one)" if axis == "`mesh`" else axis for axis in over
        ]
    if check.variant or check.mode_pair:
        over = [
            f"{axis} (`default`: the preferred one)" if axis == "`scan_layers`" else axis
            for axis in over
        ]
    return ", ".join(over) or "family"


def _needs(check: Check) -> str:
    needs = []
    if check.capability:
        needs.append(f"`{spelling(check.capability)}`")
    if len(set(check.layouts)) == 2:
        needs.append("both layouts")
    elif check.layouts:
        needs.append("the scanned layout" if check.layouts[0] else "the unscanned layout")
    if "quant" in check.axes:
        needs.append(f"a declared Qwix {check.quant_method or ''} mode".replace("  ", " "))
    if any(value.capability or value.layouts for _, values in check.params for value in values):
        needs.append("for some parameter values, a layout or capability")
    if check.requires is not None:
        needs.append("a condition on the family (its skip says which)")
    if check.pair:
        needs.append("a live Linen side")
    if check.references:
        needs.append("a recorded reference")
    return ", ".join(needs)


def _golden(check: Check) -> str:
    if check.golden_by_platform:
        return "per platform and XLA level"
    return "yes" if check.golden else ""


def checks_table() -> str:
    """Every check this package ships, by area: what it asserts, axes, needs, goldens."""
    rows = ["| check | area | asserts | over | needs | golden |", "|---|---|---|---|---|---|"]
    for check in sorted(BUILTIN.values(), key=lambda c: (c.area, c.name)):
        rows.append(
            f"| `{check.name}` | {check.area} | {_summary(check)} | {_over(check)} "
            f"| {_needs(check)} | {_golden(check)} |"
        )
    return "\n".join(rows) + "\n"


def _default(value: object) -> str:
    if value is None or value is False or value == [] or value == "":
        return ""
    return f"`{str(value).lower() if isinstance(value, bool) else value}`"


def options_table() -> str:
    """Every plugin option: its pytest flag, its short form, its default and its help."""
    rows = [
        "| pytest | `python -m conformance` | value | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for option in OPTIONS:
        value = option.metavar or ("|".join(option.choices) if option.choices else "")
        rows.append(
            f"| `{option.flag}` | `{option.short}` | {_cell(value)} | {_default(option.default)} "
            f"| {_cell(option.help or '')} |"
        )
    return "\n".join(rows) + "\n"


def ini_table() -> str:
    """Every ini option of the plugin, with its default."""
    rows = ["| ini option | default | what it does |", "|---|---|---|"]
    for name, help_, _, default in INI:
        rows.append(f"| `{name}` | {_default(default)} | {_cell(help_)} |")
    return "\n".join(rows) + "\n"


def emulation_table() -> str:
    """The options of ``python -m conformance`` that emulate a multi-host run."""
    rows = ["| option | value | what it does |", "|---|---|---|"]
    for action in emulation_parser()._actions:
        flag = action.option_strings[0]
        metavar = _cell(action.metavar or "")
        rows.append(f"| `{flag}` | {metavar} | {_cell(action.help or '')} |")
    return "\n".join(rows) + "\n"


def _signature(kind: type[Feature]) -> str:
    """``Kind(field, field=default)``: how a family writes the feature, with its defaults."""
    fields = [
        field.name if field.default is dataclasses.MISSING else f"{field.name}={field.default!r}"
        for field in dataclasses.fields(kind)
    ]
    return f"`{kind.__name__}({', '.join(fields)})`"


def features_table() -> str:
    """Every typed feature: how it is written, what it enables, its first-edition spelling.

    From each feature's docstring: its first paragraph, and the first sentence of its
    second, which names the first edition's spelling (or says the feature is new in the
    second edition).
    """
    rows = [
        "| feature | ability (`unsupported` key) | what it is for | first edition |",
        "|---|---|---|---|",
    ]
    kinds = [*FIRST_EDITION, *(k for k in FEATURES if k not in FIRST_EDITION)]
    for kind in kinds:
        summary, rest = (inspect.getdoc(kind) or "").split("\n\n", 2)[:2]
        first = rest.split(". ", 1)[0].removesuffix(".").removeprefix("The first edition's ")
        rows.append(
            f"| {_signature(kind)} | `{kind.capability}` | {_cell(summary)} | {_cell(first)} |"
        )
    return "\n".join(rows) + "\n"


TABLES = {
    "checks.md": checks_table,
    "options.md": options_table,
    "ini.md": ini_table,
    "emulation.md": emulation_table,
    "features.md": features_table,
}
"""Each generated file of ``_generated/`` and the function that writes it."""


def write(directory: Path) -> None:
    """Write every table of :data:`TABLES` into ``directory``."""
    directory.mkdir(exist_ok=True)
    for name, table in TABLES.items():
        (directory / name).write_text(table())


def _builder_inited(app) -> None:
    write(Path(app.srcdir) / "_generated")


def setup(app) -> dict[str, object]:
    """Register the table writer with Sphinx."""
    app.connect("builder-inited", _builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
