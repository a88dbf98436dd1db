"""Act: run the root model's reply, cell by cell, and resolve the answer it gave (and,
before the first turn, the request's setup code).

A reply's code blocks run in order in the episode's REPL (workflows/repl_steps.py); a cell
that submits an answer ends the turn there. With steering, each cell first passes the step
boundary and, if the request asks for it, the approval gate (workflows/steering_gate.py).
Then FINAL(...) or FINAL_VAR(name) outside the cells is resolved; a variable that cannot be
read becomes a note the model reads on its next turn.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from durable_rlm.workflows import defaults, dspy_program, prompts
    from durable_rlm.workflows.episode_context import EpisodeContext
    from durable_rlm.workflows.models import Message, RootCompletion
    from durable_rlm.workflows.outcome import (
        CellRecord,
        IterationOutcome,
        cell_answer,
        submitted_answer,
        text_answer,
    )
    from durable_rlm.workflows.parsing import parse_reply
    from durable_rlm.workflows.repl_steps import ReplSteps
    from durable_rlm.workflows.steering_gate import SteeringGate
    from durable_rlm.workflows.typed_outputs import ANSWER_FIELDS


class Acting:
    """What the model did this turn: its cells' outcomes and its answer, if it gave one."""

    def __init__(self, ctx: EpisodeContext, repl: ReplSteps, gate: SteeringGate) -> None:
        self.ctx = ctx
        self.repl = repl
        self.gate = gate

    async def setup(self, code: str) -> Message | None:
        """rlms's setup_code: the REPL's first cell, before the model's first turn. It is in
        the cell log like any cell, so a rebuilt REPL runs it again. If it fails, the message
        that tells the model why (the loop queues it for the first turn)."""
        s = self.ctx.state
        s.cell_count += 1
        self.ctx.display.set_phase("setup code")
        ran = await self.repl.run_cell(0, s.cell_count, code)
        if ran.error is None:
            return None
        return Message(role="user", content=prompts.SETUP_FAILED.format(error=ran.error))

    async def act(self, reply: RootCompletion) -> IterationOutcome:
        """Run the reply's cells and resolve its answer: what the model did this turn."""
        if self.ctx.rules.dspy:
            return await self.act_as_dspy(reply)
        request, s, repl, stop = self.ctx.request, self.ctx.state, self.repl, self.ctx.stop
        fields = request.output_fields or ANSWER_FIELDS
        outcome = IterationOutcome(s.iteration, reply.text, reply.mean_logprob)
        parsed = parse_reply(
            reply.text, request.code_fences, request.limits.max_cells_per_reply, inline=self.ctx.rules.rlms
        )
        blocks, signal = parsed.code_blocks, parsed.signal
        if parsed.more_blocks:
            outcome.notes.append(prompts.TOO_MANY_CELLS.format(limit=request.limits.max_cells_per_reply))
        for written in blocks:
            cell = await self.run(outcome, written)
            if cell is None:
                return outcome  # not run: rejected, or asked to answer now
            answer, notes, answered = cell_answer(cell, fields)
            outcome.notes.extend(notes)
            if answered:
                outcome.answer = answer
                return outcome
        if signal is not None and signal.kind == "final":
            outcome.answer, note = text_answer(signal.value, "final", fields)
        elif signal is not None:
            read = await repl.read_variable(signal.value)
            stop.halt_if_stopping()
            if read.value is None:
                note = (
                    prompts.READ_VAR_FAILED.format(name=signal.value, problem=read.problem)
                    if read.problem
                    else prompts.MISSING_VAR_TURN.format(name=signal.value, fence=request.code_fences[0])
                )
            else:
                outcome.answer, note = text_answer(read.value, "final_var", fields)
        else:
            note = None
        if note is not None:
            outcome.notes.append(note)
        return outcome

    async def act_as_dspy(self, reply: RootCompletion) -> IterationOutcome:
        """A DSPy program's step: the reply's `code` field is its one cell, SUBMIT its only
        answer, and what the step shows is its output as DSPy's REPL history has it."""
        fields = self.ctx.request.output_fields or ANSWER_FIELDS
        outcome = IterationOutcome(self.ctx.state.iteration, reply.text, reply.mean_logprob)
        action = dspy_program.action_of(reply.text)
        if action.runs is None or not action.runs.strip():
            # Nothing to run: DSPy's interpreter would print nothing for empty code.
            outcome.output = action.error or dspy_program.NO_OUTPUT
            return outcome
        cell = await self.run(outcome, action.runs)
        if cell is None:
            outcome.output = ""  # not run: the notes say why
            return outcome
        outcome.answer, outcome.output = submitted_answer(cell, fields)
        return outcome

    async def run(self, outcome: IterationOutcome, written: str) -> CellRecord | None:
        """One cell of the reply, through the step boundary and the approval gate; None when
        it did not run (rejected, the model reads why; or asked to answer now)."""
        s, stop = self.ctx.state, self.ctx.stop
        stop.halt_if_stopping()
        if await self.gate.checkpoint() is not None:
            return None  # asked to answer now: the loop's next boundary ends it
        s.cell_count += 1
        code = written
        if self.ctx.rules.approval:
            approved = await self.gate.approved(outcome, written)
            if approved is None:
                return None
            code = approved
        self.ctx.display.set_phase(f"cell {s.cell_count}")
        ran = await self.repl.run_cell(s.iteration, s.cell_count, code)
        stop.halt_if_stopping()
        cell = CellRecord.of(s.cell_count, code, ran)
        outcome.cells.append(cell)
        if ran.rebuild is not None:
            outcome.notes.extend(ran.rebuild.notes)  # which names a rebuild re-created, and how
        self.ctx.display.last_output = (cell.stdout + (cell.error or ""))[-defaults.PROGRESS_TEXT_CHARS :]
        return cell
