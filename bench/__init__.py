"""The benchmarks: each module is a script (`uv run python bench/NAME.py`, or
`uv run python -m bench.NAME`); what they share with the acceptance checks is in `harness`."""
