"""Command-line tools: the CLI, calibration fitting and its plot, the demo checkpoint, the env template."""
