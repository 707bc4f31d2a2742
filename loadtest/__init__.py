"""Load tests for radixserve and other OpenAI-compatible servers.

`python -m loadtest.serving --help`: the serving benchmark (throughput, TTFT, ITL, TPOT).
"""
