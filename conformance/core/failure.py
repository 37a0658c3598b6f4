"""What a check raises when two sides disagree, headed by the family and check it is about.

A check runs inside :func:`checking`, which names the family and the check; :func:`fail`
raises :class:`CheckFailure` headed ``<family> <check>:`` from there, so neither name
is threaded through the functions a check calls. Outside any :func:`checking` block a
failure carries its message alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import NoReturn


class CheckFailure(AssertionError):
    """A check found a divergence; the message is the full report."""


@dataclasses.dataclass(frozen=True)
class KnownFailure:
    """Why the pinned libraries make a check fail, and the words its report must show.

    ``shows`` is a regular expression the :class:`CheckFailure`'s ``Type: message`` must
    contain, so a known library failure never stands for another failure of its test; one
    that does not compile raises ``re.error`` where the check declares it.
    """

    reason: str
    shows: str

    def __post_init__(self) -> None:
        re.compile(self.shows)


@dataclasses.dataclass(frozen=True)
class Subject:
    """What a failure is about: a family and one of its checks."""

    family: str
    check: str

    def heading(self) -> str:
        """``<family> <check>``, the first words of every failure report."""
        return f"{self.family} {self.check}"


_SUBJECT: contextvars.ContextVar[Subject | None] = contextvars.ContextVar(
    "conformance_subject", default=None
)


@contextlib.contextmanager
def checking(family: str, check: str) -> Iterator[Subject]:
    """Head every failure raised inside the block ``<family> <check>:``."""
    subject = Subject(family, check)
    token = _SUBJECT.set(subject)
    try:
        yield subject
    finally:
        _SUBJECT.reset(token)


def current() -> Subject | None:
    """The innermost :func:`checking` block's subject, if any."""
    return _SUBJECT.get()


def fail(message: str) -> NoReturn:
    """Raise :class:`CheckFailure` with ``message``, headed by the current subject."""
    subject = current()
    raise CheckFailure(message if subject is None else f"{subject.heading()}: {message}")


def fail_if_any(title: str, problems: Sequence[str]) -> None:
    """Fail with ``title`` and one indented line per problem, if there are any."""
    if problems:
        fail(f"{title}\n  " + "\n  ".join(problems))
