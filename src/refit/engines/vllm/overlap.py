"""Refit a running ``AsyncLLM`` while it generates: its workers receive v in the background, the engine
pauses only for the commit, and every finished request says which weight version made each token.

    driver = OverlapDriver(async_llm, policy="in_place")       # or "drain", "abort"
    record = await driver.refit(v, send=lambda: trainer_engine.stage_weights(v))   # trainer rank 0 here
    out, versions = await driver.generate(prompt, params, request_id)               # the serving loop

Both sides run with ``RefitInitInfo(commit="staged")``. One refit:

1. ``collective_rpc("refit_stage", v)``: every worker starts receiving v in a thread and returns at
   once; vLLM keeps scheduling and running forward passes on the live weights (nothing live is
   written). Meanwhile every trainer rank runs ``stage_weights(v)`` (rank 0's is ``send``, run in a
   thread here). Staging ends with the vote: every process holds all of v, or the refit aborts on every
   process and the engine keeps serving v-1 (``RefitAborted`` here, live weights untouched).
2. The commit, under vLLM's own pause: ``pause_generation(mode=...)``, then vLLM's weight-update hooks
   (``start_weight_update``, ``update_weights({"version": v, "mode": "commit"})``: shadow -> live on the
   direct path, vLLM's loaders on the loader path; ``finish_weight_update(weight_version=v)``),
   ``refit_request_tokens`` (where each in-flight request switches version), ``resume_generation()``.
   The pause is called right after a token arrives (``align_s``): the engine then stops for the commit
   plus the one step that runs when the pause comes, not for part of a step more.

Policies (``POLICY_MODES``: vLLM's pause mode and whether its KV / prefix caches are cleared):
``drain`` ("wait", cleared: in-flight requests finish on v-1, new ones wait for v), ``abort`` ("abort",
cleared: in-flight requests end, marked aborted), ``in_place`` ("keep", kept: in-flight requests go on
under v with the KV cache v-1 built, as PipelineRL does; a prefix-cache hit after the commit also
reuses v-1's keys and values).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from refit.commit import TokenVersions, check_policy
from refit.errors import ConfigError, RefitAborted

POLICY_MODES = {"drain": ("wait", True), "abort": ("abort", True), "in_place": ("keep", False)}


@dataclass
class CommitRecord:
    """One commit, as the driver saw it (``time.perf_counter`` clock): ``version`` (now live) and
    ``previous``; ``paused_at`` (``pause_generation`` returned: no forward pass runs from here),
    ``resume_at`` / ``resumed_at`` (``resume_generation`` called / returned); ``pause_s`` (the pause call
    itself: with ``drain`` it waits for the in-flight requests), ``commit_s`` (vLLM's weight-update calls
    and the token query: the engine is idle for this long), ``stage_s`` (from ``refit_stage`` to every
    worker staged); ``aligned``: the pause was called right after a token arrived (``False``: no request
    was in flight, or none produced a token within ``align_s``);
    ``tokens``: per external request id, its output tokens made under ``previous``."""

    version: int
    previous: int | None
    policy: str
    stage_s: float = 0.0
    pause_s: float = 0.0
    commit_s: float = 0.0
    paused_at: float = 0.0
    resume_at: float = 0.0
    resumed_at: float = 0.0
    aligned: bool = False
    tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class _Request:
    submitted: float
    version: int | None  # live when it was submitted
    n_tokens: int = 0
    finished_at: float | None = None


class OverlapDriver:
    """Drives overlapped refits of one ``AsyncLLM`` (``engine``) and tags its requests' tokens with
    versions (module docstring). ``policy``: one of ``POLICY_MODES`` (``ConfigError`` otherwise).
    ``version``: the version live now (``initial_version`` until the first commit). ``align_s``: at a
    commit with requests in flight, wait at most this long for the next token before pausing, so the
    pause meets the engine at the start of a step (0: pause at once). Use one driver per engine, from the
    event loop that serves it; ``refit`` calls must not overlap each other."""

    def __init__(
        self, engine: Any, policy: str = "drain", *, initial_version: int | None = None, align_s: float = 0.5
    ) -> None:
        if isinstance(align_s, bool) or not isinstance(align_s, (int, float)) or not 0 <= align_s < float("inf"):
            raise ConfigError(f"OverlapDriver: align_s must be a finite number of seconds >= 0, got {align_s!r}")
        self.engine, self.policy, self.align_s = engine, check_policy(policy), align_s
        self.version = initial_version
        self.commits: list[CommitRecord] = []
        self._requests: dict[str, _Request] = {}
        self._token = asyncio.Event()  # set on every token that arrives through ``generate``

    async def refit(
        self, version: int, send: Callable[[], Any], timeout_s: float = 300.0, policy: str | None = None
    ) -> CommitRecord:
        """Stage ``version`` while the engine generates (``send``: this process's trainer side, e.g.
        ``lambda: trainer_engine.stage_weights(version)``, run in a thread), then commit it under
        ``policy`` (default: the driver's)."""
        t0 = time.perf_counter()
        await self.stage(version, send, timeout_s)
        record = await self.commit(version, policy)
        record.stage_s = record.paused_at - record.pause_s - t0
        return record

    async def stage(self, version: int, send: Callable[[], Any], timeout_s: float = 300.0) -> None:
        """Step 1: the workers receive ``version`` in the background while ``send`` runs here; returns
        once every worker holds all of it. ``RefitAborted`` (nothing committed anywhere) otherwise."""
        await self.engine.collective_rpc("refit_stage", args=(version,))
        try:
            await asyncio.to_thread(send)
        finally:
            await self._wait_staged(version, timeout_s)

    async def _wait_staged(self, version: int, timeout_s: float) -> None:
        until = time.monotonic() + timeout_s
        while True:
            states = await self.engine.collective_rpc("refit_stage_status")
            errors = [s["error"] for s in states if s.get("error")]
            if errors:
                raise RefitAborted(f"staging version {version} failed; the engine stays on {self.version}: {errors[0]}")
            if all(s.get("done") and s.get("version") == version for s in states):
                return
            if time.monotonic() > until:
                raise TimeoutError(f"refit: the workers did not stage version {version} within {timeout_s:.0f}s")
            await asyncio.sleep(0.005)

    async def commit(self, version: int, policy: str | None = None) -> CommitRecord:
        """Step 2: pause (per ``policy``, default the driver's), make ``version`` live through vLLM's
        weight-update calls, learn where each in-flight request switches version, resume."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        policy = self.policy if policy is None else check_policy(policy)
        mode, clear = POLICY_MODES[policy]
        record = CommitRecord(version, self.version, policy)
        record.aligned = await self._next_token()
        t0 = time.perf_counter()
        await self.engine.pause_generation(mode=mode, clear_cache=clear)
        record.paused_at = t1 = time.perf_counter()
        try:
            await self.engine.start_weight_update()
            await self.engine.update_weights(
                WeightTransferUpdateRequest(update_info={"version": version, "mode": "commit"})
            )
            tokens = (await self.engine.collective_rpc("refit_request_tokens"))[0]
            await self.engine.finish_weight_update(weight_version=str(version))
        finally:
            record.resume_at = time.perf_counter()
            await self.engine.resume_generation()
            record.resumed_at = time.perf_counter()
        record.pause_s, record.commit_s = t1 - t0, record.resume_at - t1
        record.tokens = {_external(r): n for r, n in tokens.items()}
        for rid, req in self._requests.items():  # not in the runner at the commit: finished or still waiting
            if rid not in record.tokens and req.finished_at is None:
                record.tokens[rid] = req.n_tokens
        self.version = version
        self.commits.append(record)
        return record

    async def _next_token(self) -> bool:
        """Wait (at most ``align_s``) for the next token of a request in flight; ``True`` if one came."""
        if self.align_s == 0 or not any(r.finished_at is None for r in self._requests.values()):
            return False
        self._token.clear()
        try:
            await asyncio.wait_for(self._token.wait(), self.align_s)
        except asyncio.TimeoutError:  # an alias of TimeoutError from Python 3.11 only
            return False
        return True

    def in_flight(self) -> dict[str, int]:
        """Requests under way through ``generate``: their output tokens so far, by request id."""
        return {rid: r.n_tokens for rid, r in self._requests.items()}

    async def generate(self, prompt: Any, params: Any, request_id: str) -> tuple[Any, TokenVersions, list[float]]:
        """``engine.generate`` to the end; returns the final output, the weight version of each token
        (``TokenVersions``; ``aborted`` when the engine aborted it) and each token's arrival time."""
        req = self._requests[request_id] = _Request(time.perf_counter(), self.version)
        final, arrivals = None, []
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                n = len(out.outputs[0].token_ids)
                if n > req.n_tokens:
                    self._token.set()
                arrivals += [time.perf_counter()] * (n - req.n_tokens)
                req.n_tokens, final = n, out
            req.finished_at = time.perf_counter()
            aborted = final is not None and final.outputs[0].finish_reason == "abort"
            return final, self._versions(request_id, req, aborted), arrivals
        finally:
            del self._requests[request_id]

    def _versions(self, request_id: str, req: _Request, aborted: bool) -> TokenVersions:
        changes = [(0, req.version)]
        for c in self.commits:
            if request_id not in c.tokens:
                continue  # before this request, or it had finished before the commit
            at = c.tokens[request_id]
            changes = [x for x in changes if x[0] < at] + [(at, c.version)]
        return TokenVersions(tuple(changes), req.n_tokens, aborted)


class AsyncLLMClient:
    """vLLM's four weight-sync calls, blocking, on an ``AsyncLLM`` served by the event loop ``loop`` of
    this process (for ``RefitTrainerEngine.trainer_init`` on trainer rank 0, which calls them from its
    own threads). ``private_channel``: the calls stay inside this process and its engine."""

    private_channel = True

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine, self.loop = engine, loop

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._call(self.engine.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._call(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call(self.engine.finish_weight_update(weight_version=weight_version))


def _external(internal_id: str) -> str:
    """vLLM's internal request id is the caller's id, a dash and 8 random characters."""
    return internal_id[:-9] if len(internal_id) > 9 and internal_id[-9] == "-" else internal_id
