"""semif-serve: SemIf option-logit decisions over HTTP, one forward pass and no decoding."""

import os

__version__ = "0.2.0"
# The upstream commit whose prompt, readout and result dict this service reproduces.
SEMIF_COMMIT = "23cf1f39fc9534fe81437200959b6dfc7106e45a"

# Read by OpenMP when torch loads, so set here, first: after each parallel op torch's idle workers
# spin 300k rounds (~10 ms on the CPUs measured) before sleeping, holding the core the gated delta
# rule's second thread then runs on (engine.delta_rule_rows); 30k measured fastest (docs/packing.md).
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
