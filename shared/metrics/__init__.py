"""Prometheus metrics every service exports: one registry per process (registry.py), the
`/metrics` and `/health` endpoints on --metrics-port (server.py), and what every service
measures of the bus (bus.py)."""
