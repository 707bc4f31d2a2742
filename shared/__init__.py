"""Code several radixserve services import: messages, the bus, configuration, model files."""
