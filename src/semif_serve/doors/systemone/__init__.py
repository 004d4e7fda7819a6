"""The System One door: TypeSafe's wire format at /v1/systemone and /v1/models."""
