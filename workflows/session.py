"""A persistent session: one long-running workflow over many `completion()` calls (rlms's
`persistent=True`), each call a `turn` update answered with that turn's result.

    session (this workflow)           turn k (an EpisodeWorkflow, id <session>-turn<k>)
      turn update k  ---------------> a fresh conversation over the session's REPL:
                                      its setup cell binds context_k (and history_j),
                                      then the loop, to an answer
      <- the turn's result, the REPL it left (cell-log head, snapshot, variables)
      ...
      close update, or idle_timeout without a turn: the session ends

The REPL is the session's: every turn's sandbox runs under the session's id, so a turn
finds the sandbox the last one left on its worker, or rebuilds it from the cell log and the
session's own snapshots on another (a killed worker loses nothing: the log is the state).
The session holds only that state and a short record per turn, and continues as new after
many turns. Turns run one at a time; a client that dies mid-turn loses nothing, since the
turn runs on and its record says how it ended.

Deterministic: time from workflow.now(), the seed from workflow.random(); the turns are
child workflows and the idle timeout a durable timer on the server.
"""

import functools
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from temporalio.workflow import ParentClosePolicy

    from durable_rlm.workflows import metadata, names
    from durable_rlm.workflows.models import (
        EpisodeRequest,
        EpisodeResult,
        SessionTurn,
    )
    from durable_rlm.workflows.repl_steps import close_sandbox_here
    from durable_rlm.workflows.retries import describe_failure
    from durable_rlm.workflows.session_models import (
        TURN_ANSWER_CHARS,
        CloseRequest,
        SessionCarry,
        SessionEnd,
        SessionEndedBy,
        SessionStart,
        SessionState,
        TurnRecord,
        TurnRequest,
        TurnResult,
    )


def turn_task(task: str, contexts: int, histories: int) -> str:
    """The turn's task with rlms's notes on what the REPL holds, in its words
    (rlm/utils/prompts.py, build_user_prompt)."""
    notes = []
    if contexts > 1:
        notes.append(
            f"Note: You have {contexts} contexts available (context_0 through context_{contexts - 1})."
        )
    if histories == 1:
        notes.append("Note: You have 1 prior conversation history available in the `history` variable.")
    elif histories > 1:
        notes.append(
            f"Note: You have {histories} prior conversation histories available "
            f"(history_0 through history_{histories - 1})."
        )
    return "\n\n".join([task, *notes])


def turn_request(
    start: SessionStart, state: SessionCarry, ask: TurnRequest, session_id: str
) -> EpisodeRequest:
    """Turn `ask.turn`'s episode: the session's settings, a new task and conversation, the
    session's REPL; the template's setup cell runs while the REPL is empty (then it is in the
    log), before the turn's own. Raises ValueError (pydantic's) for a request that is not valid."""
    template = start.template
    empty = state.repl.log_head is None  # no turn has ended yet (or each one failed)
    cells = [template.setup_code if empty else None, ask.setup_code]
    setup = "\n".join(c for c in cells if c) or None
    return EpisodeRequest.model_validate(
        {
            **template.model_dump(),
            "task": turn_task(ask.task, *counts_after(state, ask)),
            "context": state.context.model_dump() if state.context is not None else None,
            "setup_code": setup,
            "seed": state.seed,
            "session": SessionTurn(session_id=session_id, turn=ask.turn, repl=state.repl).model_dump(),
        }
    )


def counts_after(state: SessionCarry, ask: TurnRequest) -> tuple[int, int]:
    """The contexts and histories the REPL holds once the turn's setup cell ran."""
    contexts = ask.context_index + 1 if ask.context_index is not None else state.contexts
    return contexts, state.histories + len(ask.history_turns)


@workflow.defn(name=names.SESSION_WORKFLOW)
class SessionWorkflow:
    @workflow.init
    def __init__(self, start: SessionStart) -> None:
        # The state is set up here, not in the run method: a turn may arrive with the start.
        self._start = start
        if start.carry is not None:
            self._s = start.carry
        else:
            seed = start.template.seed
            if seed is None:
                seed = workflow.random().randint(0, 2**31 - 1)
            self._s = SessionCarry(seed=seed, touched=workflow.now())
        self._running: int | None = None
        self._closing: str | None = None
        self._ended: SessionEndedBy | None = None
        self._turns_this_run = 0
        self._changes = 0  # what the run method waits on: a turn began or ended, a close came

    @workflow.run
    async def run(self, start: SessionStart) -> SessionEnd:
        s = self._s
        while True:
            if self._closing is not None and self._running is None:
                ended_by: SessionEndedBy = "closed"
                break
            left: float | None = None
            if self._running is None:
                left = (s.touched + start.idle_timeout - workflow.now()).total_seconds()
                if left <= 0:
                    ended_by = "idle"
                    break
                if self._continue_now():
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    workflow.continue_as_new(start.model_copy(update={"carry": s}))
            seen = self._changes
            try:
                await workflow.wait_condition(functools.partial(self._changed_since, seen), timeout=left)
            except TimeoutError:
                pass
        self._ended = ended_by
        await self._close_sandbox()
        await workflow.wait_condition(workflow.all_handlers_finished)
        reason = self._closing if ended_by == "closed" else f"no turn for {start.idle_timeout}"
        return SessionEnd(
            session_id=workflow.info().workflow_id,
            turns=len(s.turns),
            ended_by=ended_by,
            reason=reason or "",
            episodes=[t.episode_id for t in s.turns],
        )

    def _changed_since(self, seen: int) -> bool:
        return self._changes != seen

    def _continue_now(self) -> bool:
        start = self._start
        if start.turns_per_run is not None and self._turns_this_run >= start.turns_per_run:
            return True
        return workflow.info().is_continue_as_new_suggested()

    # --- turns ---------------------------------------------------------------------------------

    @workflow.update(name=names.SESSION_TURN)
    async def turn(self, ask: TurnRequest) -> TurnResult:
        """Run one turn to its end; its answer (or why it failed) is the update's result."""
        start, s = self._start, self._s
        session_id = workflow.info().workflow_id
        episode_id = names.turn_episode_id(session_id, ask.turn)
        if ask.context is not None:
            s.context = ask.context  # the REPL is empty (validated): its `context` from now on
        request = turn_request(start, s, ask, session_id)
        record = TurnRecord(
            turn=ask.turn, episode_id=episode_id, task=metadata.shorten(ask.task), started_at=workflow.now()
        )
        s.turns.append(record)
        self._running = ask.turn
        self._changes += 1
        shown = metadata.PRIVATE_TEXT if request.private_text else ask.task
        try:
            result: EpisodeResult = await workflow.execute_child_workflow(
                names.WORKFLOW,
                request,
                id=episode_id,
                result_type=EpisodeResult,
                task_timeout=timedelta(seconds=request.durability.task_timeout_s),
                parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
                search_attributes=(
                    metadata.start_search_attributes(shown, request.root_model.model)
                    if start.search_attributes
                    else None
                ),
                static_summary=metadata.shorten(f"session turn {ask.turn}: {shown}"),
                memo={"session": session_id, "turn": ask.turn},  # the episode's own memo joins it
            )
        except ChildWorkflowError as err:
            # The REPL stays where the last turn that ended left it: this turn's cells are lost.
            record.status, record.error = "failed", describe_failure(err)
            self._turn_ended(record)
            return TurnResult(turn=ask.turn, episode_id=episode_id, error=record.error)
        if result.repl is not None:
            s.repl = result.repl
            s.contexts, s.histories = counts_after(s, ask)
            s.unbound = [ask.turn]
        record.status = "completed"
        record.answer = result.answer[:TURN_ANSWER_CHARS] if result.answer is not None else None
        record.ended_by, record.conversation = result.ended_by, result.conversation
        self._turn_ended(record)
        return TurnResult(turn=ask.turn, episode_id=episode_id, result=result)

    @turn.validator
    def _turn_allowed(self, ask: TurnRequest) -> None:
        if self._ended is not None or self._closing is not None:
            now = "closing" if self._ended is None else "ended"
            raise ValueError(f"the session is {now}: start a new one")
        if self._running is not None:
            raise ValueError(f"turn {self._running} is running: one turn at a time")
        expected = len(self._s.turns)
        if ask.turn != expected:
            raise ValueError(f"the next turn is {expected}, not {ask.turn} (another client took it?)")
        s = self._s
        if ask.context is not None and s.repl.log_head is not None:
            raise ValueError("the REPL's `context` is set: later contexts are bound by the setup cell")
        if ask.context_index is not None and ask.context_index != s.contexts:
            raise ValueError(f"the next context is context_{s.contexts}, not context_{ask.context_index}")
        if ask.history_turns != s.unbound:
            raise ValueError(f"the setup cell must bind the histories of turns {s.unbound}")
        context = ask.context if ask.context is not None else s.context
        turn_request(self._start, s.model_copy(update={"context": context}), ask, workflow.info().workflow_id)

    def _turn_ended(self, record: TurnRecord) -> None:
        record.ended_at = self._s.touched = workflow.now()
        self._running = None
        self._turns_this_run += 1
        self._changes += 1

    # --- the end, and what a client reads ------------------------------------------------------

    @workflow.update(name=names.SESSION_CLOSE)
    async def close(self, request: CloseRequest) -> SessionState:
        """End the session once no turn runs (a running turn ends first)."""
        if self._closing is None:
            self._closing = request.reason
            self._changes += 1
        await workflow.wait_condition(lambda: self._ended is not None)
        return self.state()

    @workflow.query(name=names.SESSION_STATE)
    def state(self) -> SessionState:
        s = self._s
        return SessionState(
            session_id=workflow.info().workflow_id,
            open=self._ended is None and self._closing is None,
            running=self._running,
            closing=self._closing,
            ended_by=self._ended,
            idle_timeout=self._start.idle_timeout,
            contexts=s.contexts,
            histories=s.histories,
            unbound=list(s.unbound),
            repl=s.repl.model_copy(),
            turns=list(s.turns),
        )

    async def _close_sandbox(self) -> None:
        """The session's sandbox, on this worker if the last turn ran here; elsewhere the idle
        reaper ends it (nothing is lost either way: the cell log is the state)."""
        try:
            await close_sandbox_here("close the session's sandbox")
        except Exception:  # noqa: BLE001 - best effort: idle reaping covers a sandbox left open
            workflow.logger.info("session %s: its sandbox was not closed here", workflow.info().workflow_id)
