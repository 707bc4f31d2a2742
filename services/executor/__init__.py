"""The executor: the model, the KV pool, the batch loop and sampling, on a GPU group or the CPU."""
