"""The engine: loading a checkpoint, running rows (prefill, fork, suffix forward, readout),
batching, the state cache, the worker thread and device memory."""
