"""Each part of an episode's state has its owners: the modules of workflows/ that may write it
(workflows/episode_context.py `STATE_OWNERS`). A write from anywhere else fails here, so a
change that lets a second collaborator write a field has to say so in the table.

The scan reads the source: an assignment (`s.field = ...`, `s.field += ...`, a tuple target)
or a mutating call (`s.field.append(...)`) on an expression that names the state: `s`,
`state` or `carry`, or an attribute `.state`, `._s`, `._state` (the names the workflow code
uses for it; a test below keeps it that way).
"""

from __future__ import annotations

import ast
from pathlib import Path

from durable_rlm.workflows.episode_context import STATE_BUILDERS, STATE_OWNERS, EpisodeRules
from durable_rlm.workflows.models import EpisodeCarry, EpisodeRequest, ModelSettings

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
FIELDS = frozenset(EpisodeCarry.model_fields)
STATE_NAMES = frozenset({"s", "state", "carry"})
STATE_ATTRIBUTES = frozenset({"state", "_s", "_state"})
MUTATORS = frozenset({"append", "extend", "insert", "pop", "clear", "update", "remove", "setdefault"})


def _names_the_state(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in STATE_NAMES
    return isinstance(node, ast.Attribute) and node.attr in STATE_ATTRIBUTES


def _field_written(target: ast.expr) -> str | None:
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and target.attr in FIELDS and _names_the_state(target.value):
        return target.attr
    return None


def state_writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of every write to a field of the state in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
                field = _field_written(item)
                if field is not None:
                    found.append((node.lineno, field))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                field = _field_written(node.func.value)
                if field is not None:
                    found.append((node.lineno, field))
    return sorted(found)


def test_the_scan_sees_every_kind_of_write() -> None:
    source = (
        "s.iteration += 1\n"
        "self.state.log_head, self.state.repl_queue = a, None\n"
        "state.pending.append(m)\n"
        "self._s.policy_state['k'] = 1\n"
        "s.unknown = 2\n"  # not a field: not the state's
        "other.iteration = 3\n"  # not the state
        "print(s.iteration)\n"  # a read
    )
    assert state_writes(source) == [
        (1, "iteration"),
        (2, "log_head"),
        (2, "repl_queue"),
        (3, "pending"),
        (4, "policy_state"),
    ]


def test_every_field_of_the_state_has_its_owners() -> None:
    assert set(STATE_OWNERS) == FIELDS


def test_each_module_writes_only_the_state_it_owns() -> None:
    trespasses = []
    for path in sorted(WORKFLOWS.glob("*.py")):
        if path.stem in STATE_BUILDERS:
            continue
        for line, field in state_writes(path.read_text()):
            if path.stem not in STATE_OWNERS[field]:
                trespasses.append(
                    f"workflows/{path.name}:{line} writes {field} (owners: {STATE_OWNERS[field]})"
                )
    assert trespasses == []


def test_the_state_is_only_ever_named_as_the_scan_expects() -> None:
    """An annotation `EpisodeCarry` on a parameter or attribute of another name would hide
    its writes from the scan."""
    odd = []
    for path in sorted(WORKFLOWS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arg) and _annotated_carry(node.annotation):
                if node.arg not in STATE_NAMES | STATE_ATTRIBUTES:
                    odd.append(f"{path.name}:{node.lineno} parameter {node.arg}")
            if isinstance(node, ast.AnnAssign) and _annotated_carry(node.annotation):
                target = node.target
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "?")
                if name not in STATE_NAMES | STATE_ATTRIBUTES:
                    odd.append(f"{path.name}:{node.lineno} {name}")
    assert odd == []


def _annotated_carry(annotation: ast.expr | None) -> bool:
    return annotation is not None and "EpisodeCarry" in ast.unparse(annotation)


def test_the_rules_are_decided_from_the_request_alone() -> None:
    request = EpisodeRequest(task="t", root_model=ModelSettings(model="m"), approve="risky")
    rules = EpisodeRules.of(request)
    assert rules == EpisodeRules.of(request.model_copy(deep=True))
    assert rules.approval and rules.extraction and not rules.policy_sees_printed_output
    assert not EpisodeRules.of(request.model_copy(update={"approve": "none"})).approval
