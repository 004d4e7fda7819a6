"""The doors: the shared door base, then one subpackage per wire format (native, System One)."""
