"""What a cache- or load-aware gateway reads from a worker, in SGLang's shapes: `GET /v1/loads` and
`GET /server_info`. The Shepherd model gateway (`smg`) polls `/v1/loads` for every ready worker and balances on
`num_running_reqs`, `num_waiting_reqs` and `token_usage`; a worker that lacks it is balanced on the gateway's own
count of requests in flight. One engine is one data-parallel rank (`dp_rank` 0)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

from worker.config import EngineConfig

from .metrics import Metrics

THROUGHPUT_WINDOW_S = 10.0  # generation tokens per second are averaged over at least this long


class LoadReport:
    """Builds the JSON bodies from rank 0's latest snapshot and the front end's token counter."""

    def __init__(self, config: EngineConfig, metrics: Metrics):
        self.config, self.metrics = config, metrics
        self._lock = threading.Lock()
        self._mark = (time.monotonic(), 0.0)  # (when, generation tokens then)
        self._throughput = 0.0

    def _generated(self) -> float:
        name = "eaglegate_generation_tokens_total"
        return self.metrics.registry.get_sample_value(name, {"model_name": self.metrics.model_name}) or 0.0

    def gen_throughput(self) -> float:
        """Tokens per second since the previous window closed (a window closes once it is THROUGHPUT_WINDOW_S old)."""
        now, total = time.monotonic(), self._generated()
        with self._lock:
            since, then = self._mark
            if now - since >= THROUGHPUT_WINDOW_S or total < then:
                self._throughput = max(0.0, total - then) / max(now - since, 1e-9)
                self._mark = (now, total)
            return self._throughput

    def loads(self, engine) -> dict:
        s = engine.stats.snapshot
        pc = s.prefix_cache
        total = s.kv_total_tokens or (engine.ready.kv_total_tokens if engine.ready else 0)
        load = {
            "dp_rank": 0,
            "num_running_reqs": s.running,
            "num_waiting_reqs": s.waiting,
            "num_total_reqs": s.running + s.waiting,
            "num_used_tokens": s.kv_used_tokens,
            "max_total_num_tokens": total,
            "token_usage": round(s.kv_used_tokens / total, 6) if total else 0.0,
            "gen_throughput": round(self.gen_throughput(), 3),
            "cache_hit_rate": round(pc.hit_rate, 6) if pc is not None else 0.0,
            "utilization": round(s.running / self.config.max_running_requests, 6),
            "max_running_requests": self.config.max_running_requests,
        }
        stamp = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return {"timestamp": stamp, "dp_rank_count": 1, "loads": [load]}

    def server_info(self, engine, served_model_name: str) -> dict:
        c = self.config
        return {
            "model_path": c.model_path,
            "served_model_name": served_model_name,
            "tp_size": c.tp_size,
            "dp_size": 1,
            "nnodes": c.nnodes,
            "max_running_requests": c.max_running_requests,
            "max_total_num_tokens": engine.ready.kv_total_tokens,
            "context_length": engine.ready.max_model_len,
            "dtype": c.dtype,
            "speculative_algorithm": c.spec.algorithm if c.spec.enabled else None,
            "version": "0.1.0",
        }
