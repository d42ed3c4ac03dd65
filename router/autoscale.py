"""The planner inside the live router: it watches the request path, decides every interval,
and has the Scaler carry the decision out (with a launcher), or only recommends it (without
one: the decision is logged, exported and shown by `pdserve status`, and an operator or a
Kubernetes backend acts on it)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from router.core import RouterCore
from router.planner import Arrival, Decision, Finished, Observation, Planner
from router.request import RequestFailed, RequestState
from router.scaling import Scaler

log = logging.getLogger(__name__)


class PlannerLoop:
    def __init__(self, core: RouterCore, scaler: Scaler, planner: Planner, interval_s: float) -> None:
        self.core, self.scaler, self.planner, self.interval_s = core, scaler, planner, interval_s
        self.arrivals: list[Arrival] = []
        self.finished: list[Finished] = []
        self.prompt_tokens = self.cached_tokens = 0
        self.failed = 0  # since the router started: requests refused or failed (pdserve status)
        self.failed_now = 0  # of those, the ones admitted this interval: misses for the planner
        self.open: dict[int, RequestState] = {}  # the requests in flight, by id(): the backlog is theirs
        self.since = time.monotonic()
        self.last: Decision | None = None
        self._task: asyncio.Task | None = None
        self._scaling: dict[str, asyncio.Task] = {}
        core.observers.append(self)
        core.planner_status = json.dumps({"mode": planner.name, "decision": None})

    # ---- observations (RouterCore's observer hooks) ------------------------------------------
    def on_start(self, st: RequestState) -> None:
        self.arrivals.append(Arrival(len(st.prompt), st.params.max_tokens, at_s=st.arrival))
        self.open[id(st)] = st

    def on_token(self, st: RequestState, n: int, now: float) -> None:
        pass

    def on_finish(self, st: RequestState, msg) -> None:
        t = msg.timings
        ttft_slo, tpot_slo = self.planner.request_slos(len(st.prompt), st.completion_tokens)
        self.finished.append(Finished(len(st.prompt), st.completion_tokens, st.queue_s, t.ttft, t.tpot, ttft_slo,
                                      tpot_slo, st.decode_batch or None))
        self.prompt_tokens += len(st.prompt)
        self.cached_tokens += st.cached_tokens
        self.open.pop(id(st), None)

    def on_abort(self, st: RequestState) -> None:
        self.open.pop(id(st), None)

    def on_fail(self, st: RequestState | None, err: RequestFailed) -> None:
        self.failed += 1
        if st is not None:  # admitted, then refused or failed (a malformed request never was)
            self.failed_now += 1
            self.open.pop(id(st), None)

    # ---- the loop -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._scaling.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # a planning error must not stop the router; the next interval retries
                log.exception("planner interval failed")

    async def tick(self) -> Decision:
        now = time.monotonic()
        obs = Observation(self.since, now, self.arrivals, self.finished, self.prompt_tokens, self.cached_tokens,
                          waiting=sum(st.first_sent is None for st in self.open.values()), failed=self.failed_now)
        self.arrivals, self.finished, self.since, self.failed_now = [], [], now, 0
        self.prompt_tokens = self.cached_tokens = 0
        # The pools' targets, not the workers counted now: a worker that registers before its
        # launch call returns would count twice, and a draining one not at all.
        current = {pool: self.core.targets.get(pool, len(self.core.members.active(pool)))
                   for pool in self.core.cfg.roles}
        # Off the event loop: at a few hundred workers' load the SLA planner replays thousands of
        # arrivals per candidate size, 0.3 s a plan (1.2 s at worst) on the Azure trace at 512
        # workers, which the loop would otherwise spend not relaying tokens. The planner's state is
        # its own; request_slos, called from the loop meanwhile, reads only the profile.
        decision = await asyncio.to_thread(self.planner.plan, obs, current)
        self.last = decision
        acted = self.core.launcher is not None
        self.core.planner_status = json.dumps({"mode": self.planner.name, "acting": acted, "failed": self.failed,
                                               "decided_at_unix": time.time(),
                                               "decision": _plain(decision.to_dict())})
        for pool, want in decision.desired.items():
            if want == current.get(pool):
                continue
            if not acted:
                log.warning("planner recommends %s for %s (now %s); no launcher here to carry it out", want, pool,
                            current.get(pool))
            elif pool in self._scaling and not self._scaling[pool].done():
                log.info("planner: %s is still resizing; %d waits for the next interval", pool, want)
            else:  # pools resize side by side; starting workers takes a while
                self._scaling[pool] = asyncio.create_task(self._scale(pool, want))
        return decision

    async def _scale(self, pool: str, want: int) -> None:
        try:
            await self.scaler.scale(pool, want)
        except RequestFailed as e:
            log.warning("planner could not resize %s to %d: %s", pool, want, e.message)
        except Exception:
            log.exception("planner could not resize %s to %d", pool, want)


def _plain(value):
    """JSON without infinities (the decision's inputs may hold them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
