"""The native door: SemIf's result dicts at /decide and /decide/shared."""
