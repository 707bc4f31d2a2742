"""The tokenizer service: chat templates, tokenization, prompt-length checks."""
