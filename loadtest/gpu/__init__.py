"""Sections of the GPU benchmark (loadtest/gpu_bench.py runs each in its own process)."""
