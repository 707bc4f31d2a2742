"""The grammar service: compiles structured-output constraints and caches them in Redis."""
