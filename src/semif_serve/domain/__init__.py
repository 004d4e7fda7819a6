"""The ground layer: questions, options, outcomes and errors; the prompt, the answer alphabet,
orderings, calibration math and numerics. It imports nothing above it."""
