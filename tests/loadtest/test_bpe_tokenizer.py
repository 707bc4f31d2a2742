"""The structured benchmark's tokenizer: a vocabulary as full as Llama 3's."""

from __future__ import annotations

from loadtest.gpu.models import make_bpe_tokenizer
from shared.grammar import GrammarTokenizer


def test_every_ordinary_id_is_a_real_token_and_text_round_trips() -> None:
    first_special, vocab_size = 4096, 4100
    tok = make_bpe_tokenizer(first_special, vocab_size)
    assert len(tok) == vocab_size
    assert tok.eos_token_id == first_special + 1
    text = '{"name": "Ada", "ids": [1, 22, 333]}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)  # merged, not byte by byte
    # xgrammar sees no empty (special) id below the specials: each would cost it per token.
    info = GrammarTokenizer.build(tok, vocab_size, [tok.eos_token_id]).info
    assert info.vocab_size == vocab_size
    assert not [i for i in info.special_token_ids if i < first_special]
