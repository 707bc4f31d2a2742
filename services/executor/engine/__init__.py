"""The executor's step loop: loop.py (the Engine), admission.py (may a request enter),
outputs.py (what a step sends), records.py (what a step leaves behind). Import from those
modules; this package imports nothing, so that the model runner and the sampler may use
records.py without importing the loop."""
