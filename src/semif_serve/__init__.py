"""semif-serve: SemIf option-logit decisions over HTTP, one forward pass and no decoding."""

__version__ = "0.2.0"
# The upstream commit whose prompt, readout and result dict this service reproduces.
SEMIF_COMMIT = "23cf1f39fc9534fe81437200959b6dfc7106e45a"
