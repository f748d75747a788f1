"""Keeps an engine serving: when its worker group dies (a rank killed, diverged or timed out) the engine fails
every in-flight request at once; the supervisor keeps /health red with the reason, then starts a fresh worker
group in the background (at most `max_restarts` times) and swaps it in."""

from __future__ import annotations

import logging
import threading
import time

from runtime.engine import Engine
from worker.config import EngineConfig

log = logging.getLogger("eaglegate.supervisor")


class EngineSupervisor:
    def __init__(self, config: EngineConfig, metrics, restart: bool = True, max_restarts: int = 5):
        self.config, self.metrics = config, metrics
        self.restart, self.max_restarts = restart, max_restarts
        self.restarts = 0
        self.last_failure: str | None = None
        self.restarting = False
        self._closing = False
        self.engine = self._start()
        self._thread = threading.Thread(target=self._watch, name="eaglegate-supervisor", daemon=True)
        self._thread.start()

    def _start(self) -> Engine:
        return Engine(self.config, on_step=self.metrics.on_step, on_fatal=self.metrics.on_fatal)

    def _watch(self) -> None:
        while not self._closing:
            engine = self.engine
            engine.wait_dead()
            if self._closing:
                return
            self.last_failure = engine.dead_reason
            log.error("engine failed: %s", self.last_failure)
            if not self.restart or self.restarts >= self.max_restarts:
                log.error("not restarting (%d restarts so far); /health stays red", self.restarts)
                return
            self.restarting = True
            engine.shutdown()
            time.sleep(1.0)  # back off before reloading
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
