"""Where goldens and recorded references live: a family's own directory, or the project's.

The suite's checks of a family that ships its goldens in its package
(:attr:`~conformance.contract.Family.goldens`, as the built-in families do) read and
write them there. Everything else (a zoo's families, a user's own golden tests) uses the
project's goldens directory: the ``conformance_goldens`` ini option, resolved against the
directory of the configuration file that sets it. Nothing here depends on the working
directory or on the rootdir pytest infers from the command line.
"""

from __future__ import annotations

import dataclasses
import site
import sysconfig
from pathlib import Path

from conformance.contract import Family


class GoldensError(ValueError):
    """The goldens of a run cannot be placed: no project, or a directory outside it."""


@dataclasses.dataclass(frozen=True)
class Goldens:
    """A run's goldens directories: each family's own, else the project's."""

    project: Path | None
    """The project's goldens directory (absolute); ``None`` when the run has no
    configuration file to resolve ``conformance_goldens`` against."""

    def of(self, family: Family, *, suite: bool = True) -> Path:
        """The directory holding ``family``'s goldens and references, absolute.

        ``suite``: the goldens are those of the suite's own checks, which a family that
        ships its goldens keeps in its package; a user's own test's are the project's.
        Raises :class:`GoldensError` when they are the project's and there is no project.
        """
        if suite and family.goldens is not None:
            return Path(family.goldens)
        if self.project is None:
            raise GoldensError(
                f"family {family.name!r} keeps its goldens in the project, and this run found "
                "no configuration file (pytest.ini, pyproject.toml, tox.ini or setup.cfg) to "
                "resolve conformance_goldens against: run from the project, or name its file "
                "with -c"
            )
        return self.project

    def roots(self, families: list[Family]) -> list[Path]:
        """Every directory a run of ``families`` keeps goldens in: theirs, the project's."""
        found = {self.of(family) for family in families}
        return sorted(found | ({self.project} if self.project is not None else set()))

    def describe(self, families: list[Family]) -> list[str]:
        """``gpt3: /abs/goldens`` for each of ``families``, then the project's directory."""
        lines = [f"{family.name}: {self.of(family)}" for family in families]
        return [*lines, f"project: {self.project}"]


def project_goldens(directory: Path, value: str) -> Path:
    """``value`` (the ``conformance_goldens`` option) resolved against ``directory``.

    ``directory`` is that of the configuration file setting it. A value leading outside
    ``directory`` raises :class:`GoldensError`: a project's goldens live in the project.
    """
    base = directory.resolve()
    root = (base / value).resolve()
    if not root.is_relative_to(base):
        raise GoldensError(
            f"conformance_goldens = {value} resolves to {root}, outside the project ({base}, "
            "where its configuration file is): keep goldens inside the project"
        )
    return root


def installed(path: Path) -> bool:
    """Whether ``path`` lies in an installed package (a site directory), not in a project."""
    paths = sysconfig.get_paths()
    sites = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    sites.append(site.getusersitepackages())
    here = path.resolve()
    return any(here.is_relative_to(Path(directory).resolve()) for directory in sites)
