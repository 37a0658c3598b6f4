"""An exception raised inside a side, as a report rather than a traceback.

When building, initialising, quantizing, running, training (compiling the step too),
decoding or converting one side raises, :func:`report` says which side raised, in which
call and where, the parameter the error names (when it names a shape or logical axis
names), and whether the other backend fails alike. To know that, both live sides are
probed (:func:`probe`): built, initialised, run forward and, for an error inside a
trainer, trained one step. The same error on both backends is a library limitation, not
a Linen/NNX divergence; an error on one backend alone is a divergence.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import traceback
from pathlib import Path
from types import FrameType

from conformance.contract import Family, Pair
from conformance.core.sharding import LogicalRankError
from conformance.runtime.aot import abstract_batch, batch_rows, lowered_forward
from conformance.runtime.case import Case
from conformance.runtime.modes import mode_of
from conformance.runtime.sides import SIDES, Side, live_pair, live_sides
from conformance.runtime.stepping import Training

_DOING = {
    ("model", "build"): "building the model",
    ("model", "init"): "initialising the parameters",
    ("model", "forward"): "running the forward",
    ("model", "lowered_forward"): "lowering the forward",
    ("model", "quantize"): "quantizing the parameters",
    ("model", "quantized"): "quantizing the model",
    ("model", "convert"): "quantizing the parameters",
    ("trainer", "build"): "building the trainer",
    ("trainer", "initial_state"): "creating the train state",
    ("trainer", "create"): "creating the train state",
    ("trainer", "step_fn"): "running a train step",
    ("trainer", "step"): "running a train step",
    ("decoder", "build"): "building the decoder",
    ("decoder", "init_cache"): "creating the KV cache",
    ("decoder", "init"): "creating the KV cache",
    ("decoder", "run"): "decoding",
    ("decoder", "lowered"): "lowering a decode call",
    ("decoder", "serve"): "decoding",
    ("AQT model", "build"): "building the AQT model",
    ("AQT model", "convert"): "the AQT convert",
    ("AQT model", "serve"): "serving the AQT model",
    ("train state", "advance"): "running a train step",
    ("train state", "aux_gradient"): "differentiating the auxiliary losses",
}
"""What a side was doing, by the kind of object and its method (without ``_`` and ``_impl``)."""

_MODEL_STEPS = ("building the model", "initialising the parameters", "running the forward")
_COMPILE_STEPS = ("building the model", "lowering the forward")
"""What :func:`probe` tries on devices it cannot run on (a TPU slice to compile for)."""
_TRAINER_STEPS = ("building the trainer", "creating the train state", "running a train step")

_MAX_LINES = 4
_MAX_WIDTH = 240
_MAX_PATHS = 4


@dataclasses.dataclass(frozen=True)
class Raised:
    """One side's exception: the side, what it was doing, in which method, the error."""

    side: str
    doing: str
    call: str
    error: BaseException
    case: Case | None = None
    """The case the raising side ran, when its object says (a train state's may be a
    derived one, an AQT train step's, say); ``None``: the check's own case."""

    @property
    def kind(self) -> str:
        """The exception's class name (``AssertionError``)."""
        return type(self.error).__name__

    def message(self) -> list[str]:
        """The exception's message, at most a few lines, each cut to a readable width."""
        lines = [line for line in str(self.error).splitlines() if line.strip()] or [""]
        cut = [line if len(line) <= _MAX_WIDTH else line[:_MAX_WIDTH] + " ..." for line in lines]
        extra = [f"... ({len(lines) - _MAX_LINES} more lines)"] if len(lines) > _MAX_LINES else []
        return cut[:_MAX_LINES] + extra

    def alike(self, other: Raised) -> bool:
        """Whether ``other`` is the same error in the same call (up to the side's name)."""
        return (self.doing, self.kind, self.message()) == (other.doing, other.kind, other.message())


def _normalised(method: str) -> str:
    return "build" if method == "__init__" else method.strip("_").removesuffix("_impl")


def _owner(frame: FrameType) -> tuple[type[Side], Case | None, str, str, int] | None:
    """Who ran ``frame``'s method: side, case (if known), what it did, method, rank.

    The rank says how well the method names the call: 2 for a public method that is
    an operation of :data:`_DOING`, 1 for another public one (a backend primitive such
    as ``apply``, which every operation calls), 0 for a private one. ``__init__`` counts
    as public: building is a call of its own.
    """
    obj = frame.f_locals.get("self")
    method = frame.f_code.co_name
    if obj is None or getattr(type(obj), method, None) is None:
        return None
    part = _part(obj)
    if part is None:
        return None
    side, case, kind = part
    known = _DOING.get((kind, _normalised(method)))
    public = method == "__init__" or not method.startswith("_")
    rank = 2 if public and known else int(public)
    return side, case, known or f"calling {method}", f"{type(obj).__name__}.{method}", rank


def _part(obj: object) -> tuple[type[Side], Case | None, str] | None:
    """The side ``obj`` belongs to, its case if ``obj`` knows it, and what ``obj`` is.

    A :class:`~conformance.runtime.stepping.Training` runs its side's compiled train step,
    so an error compiling or running that program (XLA refusing it, say) is the side's.
    """
    if isinstance(obj, Training):
        return type(obj.side), obj.side.case, "train state"
    for side in SIDES.values():
        for cls, kind in side.parts.items():
            if isinstance(obj, cls):
                return side, None, kind
    return None


def raised_in(error: BaseException) -> Raised | None:
    """Which side ``error`` was raised in, and in which call, or ``None`` if in no side.

    The call is the innermost public method of a side's object on the traceback that is
    a known operation (building, running the forward, a train step, ...), else the
    innermost public method, else the innermost method of any name.
    """
    frames = traceback.walk_tb(error.__traceback__)
    owners = [found for frame, _ in frames if (found := _owner(frame))]
    if not owners:
        return None
    best = max(owner[4] for owner in owners)
    side, case, doing, call, _ = [o for o in owners if o[4] == best][-1]
    return Raised(side.name, doing, call, error, case)


def _where(frame: FrameType, line: int) -> str:
    """``file:line in function`` of a traceback entry.

    The file is shortened to its path inside ``site-packages``, or inside the working
    directory.
    """
    path = Path(frame.f_code.co_filename)
    parts = path.parts
    installed = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
    if installed:
        path = Path(*parts[installed[-1] + 1 :])
    elif path.is_relative_to(Path.cwd()):
        path = path.relative_to(Path.cwd())
    return f"{path}:{line} in {frame.f_code.co_name}"


def origin(error: BaseException) -> str:
    """Where ``error`` was raised: the innermost frame's file, line and function.

    JAX drops its own frames from a traceback, so an error inside a traced function is
    located in the model code that called JAX.
    """
    frames = list(traceback.walk_tb(error.__traceback__))
    return _where(*frames[-1]) if frames else "unknown"


def _package_dir(package: str) -> Path | None:
    """The directory of the imported top-level ``package`` (a module's file, for one)."""
    top = sys.modules.get(package)
    files = getattr(top, "__path__", None) or [getattr(top, "__file__", None) or ""]
    return Path(files[0]).resolve() if files[0] else None


def family_code(error: BaseException, family: Family) -> str | None:
    """Where ``family``'s own code (its package: model and adapter) is on a traceback.

    ``None`` when it is not on ``error``'s; ``raised in <family>'s own code ...`` when
    the innermost frame is there; else ``called from <family>'s own code at ...``, its
    innermost frame that is.
    """
    package = type(family).__module__.split(".")[0]
    home = _package_dir(package)
    frames = list(traceback.walk_tb(error.__traceback__))
    if home is None or not frames:
        return None
    own = [
        (frame, line)
        for frame, line in frames
        if Path(frame.f_code.co_filename).resolve().is_relative_to(home)
    ]
    if not own:
        return None
    if own[-1] == frames[-1]:
        return f"raised in {family.name}'s own code ({package}), not the harness's"
    return f"called from {family.name}'s own code ({package}) at {_where(*own[-1])}"


def probe(side: Side, trainer: bool) -> Raised | None:
    """How ``side`` fails built, initialised, run forward (and trained a step), or ``None``.

    The train step is probed only with ``trainer``; an error that is not raised inside
    one of the side's objects is attributed to the step being probed. On devices this
    process cannot run on (a TPU slice to compile for) the forward is only lowered.
    """
    doing = "building the model"
    try:
        runner = side.runner
        if not side.case.runs_here:  # a slice to compile for: lower, never run
            doing = "lowering the forward"
            lowered_forward(side, abstract_batch(side.case, batch_rows(side.case)))
            return None
        doing = "initialising the parameters"
        params = runner.init(0, side.shardings())
        doing = "running the forward"
        runner.forward(params, side.case.batch())
        if trainer:
            doing = "building the trainer"
            training = Training.start(side)
            doing = "running a train step"
            training.advance(side.case.batch())
    except Exception as err:
        found = raised_in(err)
        return found if found is not None else Raised(side.name, doing, doing, err)
    return None


_SHAPE = re.compile(r"\((\d+(?:, *\d+)+,?)\)")
_NAMES = re.compile(r"\(((?:'[\w.]+'|None)(?:, *(?:'[\w.]+'|None))*,?)\)")


def named_params(error: BaseException, side: Side) -> list[str]:
    """The float parameters of ``side`` whose shape (and logical names) ``error`` names."""
    text = str(error)
    shapes = {tuple(ast.literal_eval(f"({m})")) for m in _SHAPE.findall(text)}
    names = [tuple(ast.literal_eval(f"({m.rstrip(',')},)")) for m in _NAMES.findall(text)]
    if not shapes:
        return []
    try:
        runner = side.unquantized().runner
    except LogicalRankError as err:
        return list(err.leaves)
    except Exception:
        return []
    found = []
    for path, spec in sorted(runner.specs.items()):
        logical = runner.logical.get(path) or ()
        if tuple(spec.shape) not in shapes:
            continue
        if names and not any(set(n) <= set(logical) for n in names):
            continue
        found.append(f"{path}: shape {tuple(spec.shape)}, logical names {logical}")
    return found


def _verdict(raised: Raised, other: Raised | None, other_name: str, probed: tuple[str, ...]) -> str:
    if other is None:
        if raised.doing not in probed:
            return (
                f"{other_name} gets through {', '.join(probed)}; whether it fails "
                f"{raised.doing} too was not tried"
            )
        return (
            f"only {raised.side} fails: {other_name} gets through {raised.doing}. "
            "A Linen/NNX divergence, not a library limitation"
        )
    if other.alike(raised):
        return (
            f"{other.side} fails alike ({other.call}): the same error on both backends: "
            "a library limitation, not a Linen/NNX divergence"
        )
    first = f"{other.side} fails {other.doing} ({other.call}) with {other.kind}: "
    return first + " / ".join(other.message())


def report(case: Case, error: BaseException) -> str | None:
    """The report of ``error`` raised inside a side of ``case``, or ``None`` if in no side.

    Its lines: which side raised what while doing what (and in which method), the
    message, where it was raised, the parameters it names, and the other backend's
    verdict from :func:`probe`, run in the case the raising side ran when its object
    knows it (:attr:`Raised.case`).
    """
    raised = raised_in(error)
    if raised is None:
        return None
    if case.pair is not Pair.LINEN_NNX:
        first, second = live_pair(case)
        if mode_of(error) is None:
            return mode_report(error, case.family, first.name, second.name, other_ran=False)
        return mode_report(error, case.family, second.name, first.name)
    sides = {side.name: side for side in live_sides(raised.case or case)}
    trainer = raised.doing in _TRAINER_STEPS
    probed = _MODEL_STEPS + (_TRAINER_STEPS if trainer else ())
    if not (raised.case or case).runs_here:
        probed = _COMPILE_STEPS
    lines = [
        f"{raised.side} raised {raised.kind} while {raised.doing} ({raised.call})",
        *raised.message(),
        f"raised at {origin(error)}",
    ]
    if (own := family_code(error, case.family)) is not None:
        lines.append(own)
    if params := named_params(error, sides[raised.side]):
        lines.append("the parameters it names: " + "; ".join(params[:_MAX_PATHS]))
        if len(params) > _MAX_PATHS:
            lines[-1] += f"; and {len(params) - _MAX_PATHS} more"
    for name, side in sides.items():
        if name != raised.side:
            lines.append(_verdict(raised, probe(side, trainer), name, probed))
    return "\n  ".join(lines)


def mode_report(
    error: BaseException, family: Family, side: str, other: str, *, other_ran: bool = True
) -> str:
    """The report of ``error``, raised while ``side`` ran what ``other`` got through.

    For two modes of one backend (NNX in tree mode and in graph mode): the raising mode
    is named as such, and no other backend is probed. Without ``other_ran``, ``side`` is
    the default mode, every other check's, so ``other`` is not blamed.
    """
    found = raised_in(error) or Raised(side, "", "", error)
    doing = f" while {found.doing} ({found.call})" if found.doing else ""
    lines = [f"{side} raised {found.kind}{doing}", *found.message(), f"raised at {origin(error)}"]
    if (own := family_code(error, family)) is not None:
        lines.append(own)
    if other_ran:
        lines.append(f"{other} got through the same calls: a divergence of {side}, not of both")
    else:
        lines.append(
            f"{side} is the NNX model in its default mode, as the Linen-vs-NNX checks run "
            f"it: a failure of the model itself, not of {other}"
        )
    return "\n  ".join(lines)
