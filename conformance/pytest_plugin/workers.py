"""What a pytest-xdist controller and its workers hand each other.

Under ``-n N`` the tests run in worker processes; the controller only sees their
reports. Facts of a whole run that reports do not carry (the programs a worker
compiled, the goldens its collection claimed) travel in xdist's ``workeroutput``: a
worker :func:`send` s them at the end of its session, and the controller reads them
with :func:`received` when xdist tells it the worker is done (``pytest_testnodedown``).
The other way, the controller hands facts to every worker as it starts (:class:`Handover`;
the worker reads them with :func:`given`).
Values must be plain data (numbers, strings, lists, dicts).
"""

from __future__ import annotations

from typing import Any

import pytest

_PREFIX = "conformance-"


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker."""
    return hasattr(config, "workerinput")


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands tests to pytest-xdist workers and runs none itself."""
    return not is_worker(config) and bool(getattr(config.option, "numprocesses", None))


def send(config: pytest.Config, name: str, value: Any) -> None:
    """On a worker, hand ``value`` to the controller under ``name`` (elsewhere, nothing)."""
    if is_worker(config):
        config.workeroutput[_PREFIX + name] = value  # type: ignore[attr-defined]


def received(node: Any, name: str, default: Any = None) -> Any:
    """What worker ``node`` sent under ``name`` (``default`` if it sent nothing, or died)."""
    return getattr(node, "workeroutput", {}).get(_PREFIX + name, default)


def given(config: pytest.Config, name: str, default: Any = None) -> Any:
    """On a worker, what its controller handed it under ``name`` (:class:`Handover`)."""
    return getattr(config, "workerinput", {}).get(_PREFIX + name, default)


class Handover:
    """On the controller, hand every worker ``values`` (name -> plain data) as it starts."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """Xdist's hook: put the values in the worker's ``workerinput``."""
        for name, value in self.values.items():
            node.workerinput[_PREFIX + name] = value


class WholeGroups:
    """Keep each ``xdist_group`` on one worker, as ``--dist loadgroup`` promises.

    pytest-xdist 3.8 tells its controller a test's group by appending ``@group`` to the
    node id it reports (in ``item._nodeid``); pytest 9.2 keeps node ids elsewhere
    (``item._id``), so the suffix is lost and the group's tests are spread over the
    workers (pytest-xdist issue 1386). On a worker, after xdist's own hook, this appends
    the suffix where it is missing; where xdist's own took effect, it does nothing.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[Any]) -> None:
        """Append each grouped test's ``@group`` to its node id, where xdist could not."""
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
            suffix = "@" + "_".join(sorted(names))
            if names and not item.nodeid.endswith(suffix):
                from _pytest.nodeid import NodeId  # pytest >= 9.2, where the suffix is lost

                item._id = NodeId.parse(item.nodeid + suffix)
