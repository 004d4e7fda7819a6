"""Acceptance checks against a live semif-serve: parity with upstream, determinism, the negative
control, shared vs direct, order averaging and latency.

Run as `uv run python -m acceptance <command> --url URL --token-file FILE [--out RESULT.json]`.
Every command prints a short table, writes a JSON result file and exits non-zero when a gate
fails. The client side needs only the standard library and httpx: it never imports torch or
the service, so it runs from any host that can reach the service.
"""
