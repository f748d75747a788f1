"""Writes deploy/grafana/dashboards/eaglegate.json. Edit the panels here, then run this script."""

from __future__ import annotations

import json
from pathlib import Path

Q = "histogram_quantile({q}, sum by (le{by}) (rate(eaglegate_{m}_bucket[1m])))"

PANELS = [
    ("Speculative decoding", None, None, []),
    (
        "Accept length per verify step (mean, p50, p90)",
        "short",
        "timeseries",
        [
            (
                "mean",
                "sum(rate(eaglegate_spec_accept_length_sum[1m])) / sum(rate(eaglegate_spec_accept_length_count[1m]))",
            ),
            ("p50", Q.format(q=0.5, by="", m="spec_accept_length")),
            ("p90", Q.format(q=0.9, by="", m="spec_accept_length")),
        ],
    ),
    (
        "Acceptance by draft position (accepted per verify step)",
        "percentunit",
        "timeseries",
        [
            (
                "position {{position}}",
                "sum by (position) (rate(eaglegate_spec_accepted_tokens_per_position_total[1m])) "
                "/ ignoring(position) group_left sum(rate(eaglegate_spec_verify_steps_total[1m]))",
            ),
        ],
    ),
    (
        "Draft acceptance rate",
        "percentunit",
        "timeseries",
        [
            (
                "accepted / proposed",
                "sum(rate(eaglegate_spec_accepted_tokens_total[1m])) "
                "/ sum(rate(eaglegate_spec_draft_tokens_total[1m]))",
            ),
        ],
    ),
    (
        "Accepted draft tokens per second by source (EAGLE head, context lookup)",
        "short",
        "timeseries",
        [
            ("{{source}} accepted", "sum by (source) (rate(eaglegate_spec_source_accepted_tokens_total[1m]))"),
            ("{{source}} proposed", "sum by (source) (rate(eaglegate_spec_source_draft_tokens_total[1m]))"),
        ],
    ),
    (
        "Accept length and acceptance rate, last 10 s (SGLang's gauges)",
        "short",
        "timeseries",
        [
            ("accept length", "max(eaglegate_spec_accept_length_mean)"),
            ("acceptance rate", "max(eaglegate_spec_accept_rate)"),
        ],
    ),
    (
        "Per-request accept length (p10, p50): requests whose drafts stopped landing",
        "short",
        "timeseries",
        [(f"p{int(q * 100)}", Q.format(q=q, by="", m="request_spec_accept_length")) for q in (0.1, 0.5)],
    ),
    (
        "Decode steps by kind (rank 0's budget)",
        "short",
        "timeseries",
        [
            ("{{kind}}", "sum by (kind) (rate(eaglegate_spec_steps_total[1m]))"),
        ],
    ),
    (
        "Rank-0 decision sync latency (p50, p99)",
        "s",
        "timeseries",
        [
            ("p50 {{kind}}", Q.format(q=0.5, by=", kind", m="decision_sync_latency_seconds")),
            ("p99 {{kind}}", Q.format(q=0.99, by=", kind", m="decision_sync_latency_seconds")),
        ],
    ),
    (
        "Rank divergences and consistency checks",
        "short",
        "timeseries",
        [
            ("divergences (5m)", "sum(increase(eaglegate_rank_divergences_total[5m]))"),
            ("checks/s", "sum(rate(eaglegate_rank_consistency_checks_total[1m]))"),
        ],
    ),
    ("Latency", None, None, []),
    (
        "Time to first token (p50, p90, p99)",
        "s",
        "timeseries",
        [(f"p{int(q * 100)}", Q.format(q=q, by="", m="time_to_first_token_seconds")) for q in (0.5, 0.9, 0.99)],
    ),
    (
        "Inter-token latency (p50, p90, p99)",
        "s",
        "timeseries",
        [(f"p{int(q * 100)}", Q.format(q=q, by="", m="inter_token_latency_seconds")) for q in (0.5, 0.9, 0.99)],
    ),
    (
        "End-to-end request latency (p50, p90, p99)",
        "s",
        "timeseries",
        [(f"p{int(q * 100)}", Q.format(q=q, by="", m="e2e_request_latency_seconds")) for q in (0.5, 0.9, 0.99)],
    ),
    (
        "Queue time (p50, p99)",
        "s",
        "timeseries",
        [(f"p{int(q * 100)}", Q.format(q=q, by="", m="queue_time_seconds")) for q in (0.5, 0.99)],
    ),
    ("Load", None, None, []),
    (
        "Throughput (tokens/s)",
        "short",
        "timeseries",
        [
            ("generated", "sum(rate(eaglegate_generation_tokens_total[1m]))"),
            ("prompt", "sum(rate(eaglegate_prompt_tokens_total[1m]))"),
        ],
    ),
    (
        "Requests running and waiting",
        "short",
        "timeseries",
        [
            ("running", "sum(eaglegate_num_requests_running)"),
            ("waiting", "sum(eaglegate_num_requests_waiting)"),
        ],
    ),
    ("KV cache usage", "percentunit", "timeseries", [("used", "max(eaglegate_kv_cache_usage_ratio)")]),
    (
        "Finished requests by reason (per s)",
        "reqps",
        "timeseries",
        [
            ("{{finished_reason}}", "sum by (finished_reason) (rate(eaglegate_request_success_total[1m]))"),
        ],
    ),
    ("Engine steps per second", "short", "timeseries", [("steps", "sum(rate(eaglegate_engine_steps_total[1m]))")]),
    (
        "Requests refused for load (per s)",
        "reqps",
        "timeseries",
        [("{{status}}", "sum by (status) (rate(eaglegate_requests_rejected_total[1m]))")],
    ),
    ("Prefix cache", None, None, []),
    (
        "Prefix cache hit rate (prompt tokens not prefilled)",
        "percentunit",
        "timeseries",
        [
            (
                "hit rate",
                "sum(rate(eaglegate_prefix_cache_hits_tokens_total[5m])) "
                "/ sum(rate(eaglegate_prefix_cache_queries_tokens_total[5m]))",
            ),
        ],
    ),
    (
        "Prefix cache: cached tokens and evictions",
        "short",
        "timeseries",
        [
            ("cached tokens", "sum(eaglegate_prefix_cache_tokens)"),
            ("evicted tokens/s", "sum(rate(eaglegate_prefix_cache_evicted_tokens_total[1m]))"),
        ],
    ),
]


def build() -> dict:
    panels, y, x, pid = [], 0, 0, 1
    for title, unit, kind, targets in PANELS:
        if kind is None:  # a row header
            y += 8 if x else 0
            x = 0
            panels.append(
                {
                    "id": pid,
                    "type": "row",
                    "title": title,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y += 1
            pid += 1
            continue
        panels.append(
            {
                "id": pid,
                "type": kind,
                "title": title,
                "datasource": {"type": "prometheus", "uid": "prometheus"},
                "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {
                        "refId": chr(65 + i),
                        "expr": expr,
                        "legendFormat": legend,
                        "datasource": {"type": "prometheus", "uid": "prometheus"},
                    }
                    for i, (legend, expr) in enumerate(targets)
                ],
            }
        )
        pid += 1
        x = 12 - x
        if x == 0:
            y += 8
    return {
        "uid": "eaglegate",
        "title": "eaglegate",
        "tags": ["eaglegate", "llm", "speculative-decoding"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "panels": panels,
        "templating": {"list": []},
    }


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dashboards" / "eaglegate.json"
    out.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {out}")
