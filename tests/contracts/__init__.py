"""Conformance suites, one per protocol: what every storage backend and every handler must do."""
