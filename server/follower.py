"""A node other than 0 of a multi-node TP group: its local ranks, plus `/health` and `/metrics` on `--port` so the
kubelet can probe it and Prometheus can scrape it (the API is node 0's alone). `/health` is 200 while every local
rank runs; a dead rank ends the node, which ends the pod, and LeaderWorkerSet recreates the whole group."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, ProcessCollector, generate_latest

from runtime.engine import start_follower_ranks, wait_follower_ranks
from worker.config import EngineConfig

log = logging.getLogger("eaglegate.follower")


def _handler(registry: CollectorRegistry, healthy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path in ("/health", "/health/ready"):  # ready: its ranks run (the leader's says more)
                ok = healthy()
                body = {"status": "ok"} if ok else {"error": {"message": "a local rank exited", "code": 503}}
                self._send(200 if ok else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b'{"error": {"message": "not found", "code": 404}}', "application/json")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # probes every few seconds would flood the log
            pass

    return Handler


def serve_follower(config: EngineConfig, host: str, port: int) -> int:
    log.info(
        "node %d of %d: starting local TP ranks, joining %s", config.node_rank, config.nnodes, config.dist_init_addr
    )
    procs: list = []
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    node = str(config.node_rank)
    labels = ["node_rank"]
    Gauge("eaglegate_node_ranks", "TP ranks this node runs.", labels, registry=registry).labels(node).set(
        config.local_tp_size
    )
    alive = Gauge("eaglegate_node_ranks_alive", "TP ranks of this node still running.", labels, registry=registry)
    alive.labels(node).set_function(lambda: sum(p.is_alive() for p in procs))
    server = ThreadingHTTPServer((host, port), _handler(registry, lambda: all(p.is_alive() for p in procs)))
    procs += start_follower_ranks(config)  # after the bind: a taken port fails before any rank waits on the group
    threading.Thread(target=server.serve_forever, name="eaglegate-follower-http", daemon=True).start()
    print(f"eaglegate: node {config.node_rank}: health and metrics on http://{host}:{port}", flush=True)
    try:
        return wait_follower_ranks(procs)
    finally:
        server.shutdown()
        server.server_close()
