"""The REPL's `answer` dict, as rlms 0.1.3 has it: an answer counts when a cell *sets*
`answer["ready"]` to a truthy value, with `answer["content"]` as it is at that moment.

A flag left True by an earlier cell (an earlier turn of a persistent session, or a restored
snapshot) is never an answer again: what counts is the assignment, seen by `__setitem__`.
A cell that rebinds `answer` to a plain dict that is ready answers too (rlms checks that
after the cell), and the name is bound again to an `AnswerDict` holding the same items, so
the next cell's assignment is seen.

The dict is saved in snapshots like any variable, so it holds nothing but its items: the
class pickles by reference (this module is importable in every sandbox) and the answer
set goes to a module-level slot, never to a method bound to one sandbox's session.
Standard library only, like everything the sandbox loads.
"""

from __future__ import annotations

from typing import Any

_SET: list[Any] = [None]
"""The content the last `answer["ready"] = <truthy>` of the running cell set (None: none)."""


class AnswerDict(dict[str, Any]):
    """`{"content": "", "ready": False}`, which reports `answer["ready"] = True`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(content="", ready=False)
        dict.update(self, *args, **kwargs)  # building one is not setting "ready"

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        if key == "ready" and value:
            _SET[0] = _text(self.get("content", ""))

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickling with __setitem__ would report a restored `ready` as a new answer.
        return (_rebuilt, (dict(self),))


def _rebuilt(items: dict[str, Any]) -> AnswerDict:
    made = AnswerDict()
    dict.update(made, items)
    return made


def start_cell() -> None:
    """Before a cell: no answer set yet."""
    _SET[0] = None


def end_cell(namespace: dict[str, Any], rlms: bool = False) -> str | None:
    """After a cell: the answer it set, if any; a rebound plain dict keeps its items, is the
    answer if ready, and is an AnswerDict again. Any other value bound to `answer` is the
    model's own variable (`answer = 6 * 7`, then `FINAL_VAR(answer)`), kept as it is; in an
    rlms program (`rlms`) it is replaced by an empty AnswerDict, as rlms 0.1.3 puts its
    scaffold back after each cell."""
    rebound = _wrap(namespace, rlms)
    if isinstance(rebound, dict) and rebound.get("ready") and _SET[0] is None:
        _SET[0] = _text(rebound.get("content", ""))
    answer, _SET[0] = _SET[0], None
    return answer


def rewrap(namespace: dict[str, Any], rlms: bool = False) -> None:
    """After a snapshot was loaded: `answer` an AnswerDict as `end_cell` leaves it (older
    snapshots hold a plain dict); nothing it holds counts as set."""
    _wrap(namespace, rlms)
    _SET[0] = None


def _wrap(namespace: dict[str, Any], rlms: bool) -> Any:
    """Bind `answer` to an AnswerDict again where it must be one; the value it replaced."""
    current = namespace.get("answer")
    if isinstance(current, AnswerDict) or not (
        rlms or isinstance(current, dict) or "answer" not in namespace
    ):
        return None
    replacement = AnswerDict()
    if isinstance(current, dict):
        dict.update(replacement, current)
    namespace["answer"] = replacement
    return current


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception as exc:  # noqa: BLE001 - a hostile __str__
        return f"<answer could not be converted to text: {exc!r}>"
