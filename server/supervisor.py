"""Keeps an engine serving: when its worker group dies (a rank killed, diverged or timed out) the engine fails
every in-flight request at once; the supervisor keeps /health red with the reason, then starts a fresh worker
group in the background and swaps it in. Restarts back off exponentially; past `max_restarts` within
RESTART_WINDOW_S it gives up and `on_give_up` ends the process with a non-zero status, so the layer above (Docker's
restart policy, Kubernetes) starts it afresh rather than a red server staying up for ever."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from runtime.engine import Engine
from worker.config import EngineConfig
from worker.kernels import cpu_class

log = logging.getLogger("eaglegate.supervisor")
RESTART_WINDOW_S = 600.0  # restarts counted over the last ten minutes
BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0  # the wait before a restart doubles with each failure in the window


class EngineSupervisor:
    def __init__(
        self,
        config: EngineConfig,
        metrics,
        restart: bool = True,
        max_restarts: int = 5,
        on_give_up: Callable[[], None] | None = None,
    ):
        self.config, self.metrics = config, metrics
        self.restart, self.max_restarts, self.on_give_up = restart, max_restarts, on_give_up
        self.restarts = 0  # in the process's life
        self.recent: deque[float] = deque()  # failures within RESTART_WINDOW_S
        self.gave_up = False
        self.last_failure: str | None = None
        self.failed_ranks: list[dict | None] | None = None  # the last failed group's final heartbeats
        self.restarting = False
        self._closing = False
        self.engine = self._start()
        self._thread = threading.Thread(target=self._watch, name="eaglegate-supervisor", daemon=True)
        self._thread.start()

    def _start(self) -> Engine:
        engine = Engine(self.config, on_step=self.metrics.on_step, on_fatal=self.metrics.on_fatal)
        if engine.ready.cpu_kernel:
            log.info(
                "CPU kernel for quantized linears: %s (--cpu-kernel %s)%s",
                engine.ready.cpu_kernel,
                self.config.cpu_kernel,
                cpu_class.passing_note(),
            )
        return engine

    def _watch(self) -> None:
        while not self._closing:
            engine = self.engine
            engine.wait_dead()
            if self._closing:
                return
            self.last_failure = engine.dead_reason
            self.failed_ranks = engine.final_heartbeats
            log.error("engine failed: %s", self.last_failure)
            if not self.restart:
                log.error("not restarting (--no-restart-workers); /health stays red")
                return
            now = time.monotonic()
            self.recent.append(now)
            while self.recent and now - self.recent[0] > RESTART_WINDOW_S:
                self.recent.popleft()
            if len(self.recent) > self.max_restarts:
                self.gave_up = True
                log.error(
                    "%d worker-group failures within %.0f s, over the limit of %d restarts: giving up",
                    len(self.recent),
                    RESTART_WINDOW_S,
                    self.max_restarts,
                )
                if self.on_give_up is not None:
                    self.on_give_up()
                return
            self.restarting = True
            engine.shutdown()
            time.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (len(self.recent) - 1)))
            try:
                self.engine = self._start()
                self.restarts += 1
                log.info("worker group restarted (%d so far)", self.restarts)
            except Exception as e:  # noqa: BLE001 - keep serving errors rather than crash the front end
                self.last_failure = f"restart failed: {e}"
                log.error("%s", self.last_failure)
                self.restarts += 1
                continue
            finally:
                self.restarting = False

    def status(self) -> str | None:
        """None while healthy, else why not."""
        e = self.engine
        if e.is_alive:
            return None
        reason = e.dead_reason or "shutting down"
        if self.restarting:
            return f"engine down: {reason}; restarting the worker group (restart {self.restarts + 1})"
        return f"engine down: {reason}"

    def shutdown(self) -> None:
        self._closing = True
        self.engine.shutdown()
