"""The service: the decision core (HTTP-free), settings, startup and the status snapshot."""
