"""What the tests, the benchmarks and the scripts share, in one importable home: small random models and EAGLE heads
(`models`, `shaped_models`), a real server subprocess (`server`), prompts and trees (`prompts`), schemas at the grammar
limits (`schemas`), docker compose rendering (`compose`), load against a server (`load`), benchmark result naming and
provenance (`provenance`), and the Kubernetes deployment check (`deploy_check`).
The serving packages never import it."""
