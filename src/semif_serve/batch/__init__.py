"""Whole files of requests scored by the real service in one process (`semif-serve run-batch`),
or on a Ray cluster (`--ray`): OpenAI's Batch file format in, one result line per input line out
(docs/batch.md)."""
