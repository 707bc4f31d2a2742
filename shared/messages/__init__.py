"""Wire messages, one module per stream. Every type is a tagged, frozen msgspec Struct.

    tokenize.py   gateway   -> tokenizer          (rs:tokenize, consumer group)
    schedule.py   tokenizer -> scheduler -> executor (rs:schedule, rs:exec:{id})
    detok.py      tokenizer, scheduler, executor -> detokenizer (rs:detok:{p})
    reply.py      tokenizer, detokenizer -> gateway (rs:reply:{gateway})
    heartbeat.py  every instance's liveness key

New fields are appended with defaults so older readers keep decoding.
"""
