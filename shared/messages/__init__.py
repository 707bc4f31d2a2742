"""Wire messages, one module per stream. Every type is a tagged, frozen msgspec Struct.

    tokenize.py   gateway   -> tokenizer          (rs:tokenize, consumer group)
    grammar.py    tokenizer -> grammar            (rs:grammar, consumer group); cache entries
    schedule.py   tokenizer or grammar -> scheduler -> executor (rs:schedule, rs:exec:{id})
    detok.py      tokenizer, grammar, scheduler, executor -> detokenizer (rs:detok:{p})
    reply.py      tokenizer, grammar, detokenizer -> gateway (rs:reply:{gateway})
    heartbeat.py  every instance's liveness key

New fields are appended with defaults so older readers keep decoding.
"""
