"""The gateway: HTTP front door (OpenAI-compatible and SGLang-style native APIs).

It validates requests, gives them ids and deadlines, publishes them to the tokenizer, routes the
replies arriving on its own reply stream back to the waiting HTTP handlers, and turns a client
disconnect or a passed deadline into an abort.
"""
