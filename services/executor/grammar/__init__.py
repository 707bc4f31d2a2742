"""Grammar-constrained decoding in the executor, one concern a module:

- vocab.py: what every matcher shares (token bytes, stop bits, forced strings' tokens);
- matcher.py: one request's matcher (accept, rollback, done);
- jump_forward.py: text the grammar forces, appended without sampling;
- masks.py: the batch's bitmask, filled on xgrammar's threads and applied to the logits;
- lifecycle.py: what the engine does for a constrained request at start, resume and after
  each token;
- backend.py: makes each request's matcher from a compiled grammar;
- cache.py: the compiled grammars the executor holds (fetched from shared/grammar_store.py).
"""
