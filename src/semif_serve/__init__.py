"""semif-serve."""
