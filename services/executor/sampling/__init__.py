"""Sampling in the executor, one concern a module:

- step.py: one step's sampling, start to end (masks, processors, the draw, logprobs);
- sampler.py: the draw (greedy, temperature, top-k, top-p, min-p);
- processors.py: logit bias, min tokens and penalties;
- logprobs.py: log probabilities of sampled and prompt tokens.
"""
