"""Start the engine, then uvicorn; drain on SIGTERM/SIGINT and exit 0."""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from worker.config import EngineConfig

from .app import ServerSettings, build_app
from .follower import serve_follower
from .metrics import Metrics
from .parsers.registry import Parsers
from .supervisor import EngineSupervisor

log = logging.getLogger("eaglegate.serve")


FLUSH_S = 5.0  # after the drain, how long uvicorn gives open responses to send their last bytes


class _DrainingServer(uvicorn.Server):
    """On the first signal the server drains while it still listens: new generation requests and /health/ready get
    503 (a load balancer takes it out of rotation), in-flight requests run to their end for up to `drain_timeout`
    seconds; then uvicorn stops. A second signal stops it at once. What is still running then ends with an error."""

    def __init__(self, config: uvicorn.Config, app, in_flight, drain_timeout: float):
        super().__init__(config)
        self._app, self._in_flight, self._drain_timeout = app, in_flight, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        if self._app.state.draining:
            self._stop(sig, frame)
            return
        self._app.state.draining = True
        log.info("draining: up to %.0f s for %d requests in flight", self._drain_timeout, self._in_flight())
        threading.Thread(target=self._drain, args=(sig, frame), name="eaglegate-drain", daemon=True).start()

    def _drain(self, sig, frame) -> None:
        deadline = time.monotonic() + self._drain_timeout
        while self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop(sig, frame)

    def _stop(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # uvicorn would re-raise it after shutdown; we stop the engine, exit 0


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    api_key: str | None,
    stall_timeout: float,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    restart_workers: bool = True,
    parsers: Parsers = Parsers(),
    max_worker_restarts: int = 5,
    max_new_tokens_default: int | None = None,
    request_timeout: float | None = None,
    otlp_traces_endpoint: str | None = None,
) -> int:
    if config.node_rank > 0:
        return serve_follower(config, host, port)
    t0 = time.monotonic()
    name = config.served_model_name or config.model_path
    spec = config.spec
    metrics = Metrics(name, spec_positions=spec.num_steps + spec.context_tokens if spec.enabled else 0)
    server: _DrainingServer | None = None

    def give_up() -> None:  # from the supervisor's thread: drain and stop, then exit 1
        if server is not None:
            server.handle_exit(signal.SIGTERM, None)

    try:
        supervisor = EngineSupervisor(config, metrics, restart_workers, max_worker_restarts, give_up)
    except Exception as e:  # noqa: BLE001 - a start-up failure is reported, not a traceback
        print(f"eaglegate: failed to start: {e}", flush=True)
        return 1
    engine = supervisor.engine
    settings = ServerSettings(
        served_model_name=name,
        model_aliases=(config.model_path,),
        api_key=api_key,
        stall_timeout=stall_timeout,
        parsers=parsers,
        max_new_tokens_default=max_new_tokens_default,
        request_timeout=request_timeout,
        otlp_traces_endpoint=otlp_traces_endpoint,
    )
    app = build_app(supervisor, settings, metrics)
    print(
        f"eaglegate: loaded {config.model_path} (tp={config.tp_size}, dtype={config.dtype}, "
        f"speculative={spec.algorithm}{' ' + str(spec.draft_model_path or 'MTP layer') if spec.enabled else ''}) "
        f"in {time.monotonic() - t0:.1f} s; KV pool {engine.ready.kv_total_tokens} tokens",
        flush=True,
    )
    print(f"eaglegate: listening on http://{host}:{port} (OpenAI API at /v1)", flush=True)
    server = _DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_S),
        app,
        lambda: supervisor.engine.num_in_flight,
        shutdown_timeout,
    )
    try:
        server.run()
    finally:
        supervisor.shutdown()
        if app.state.tracing is not None:
            app.state.tracing.shutdown()  # the last spans reach the collector
    if supervisor.gave_up:
        print(f"eaglegate: stopped: the worker group failed too often ({supervisor.last_failure})", flush=True)
        return 1
    print("eaglegate: stopped", flush=True)
    return 0
