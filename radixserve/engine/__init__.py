"""The in-process engine: api.py (`radixserve.Engine`), pipeline.py (the services' cores wired
by queues on one stepping thread), flags.py (keyword arguments as the executor's flags)."""
