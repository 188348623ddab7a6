import pytest

from pagedserve.engine.detokenizer import IncrementalDetokenizer, raw_decoder
from pagedserve.sampling_params import SamplingParams

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 🚀🔥😀👍🏽 done",
    "mixed 你好 🚀 text with spaces  and\nnewlines",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.checkpoints import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_breaks_characters(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    assert len(ids) > len(text) // 3  # multi-byte characters really span several tokens
    d = IncrementalDetokenizer(tok, prompt, SamplingParams())
    pieces = [d.add_tokens([t]) for t in ids] + [d.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert d.output_text == text


def test_stop_string_across_tokens_is_trimmed(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    for include in (False, True):
        d = IncrementalDetokenizer(
            tok, [], SamplingParams(stop=["fox ju", "never"], include_stop_str_in_output=include)
        )
        hit = None
        for t in ids:
            n = len(d.add_tokens([t]))
            hit = d.check_stop(n)
            if hit:
                break
        assert hit == "fox ju"
        assert d.output_text == ("The quick brown fox ju" if include else "The quick brown ")


def test_streaming_holds_back_possible_stop_prefix(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["lazy dog"]))
    sent = ""
    for t in tok.encode("over the lazy"):
        d.add_tokens([t])
        sent += d.next_delta(finished=False)
    # "lazy" could begin "lazy dog": at most len("lazy dog") - 1 characters are held back
    assert "over the lazy".startswith(sent) and len(sent) >= len("over the lazy") - 7
    sent += d.next_delta(finished=True)
    assert sent == "over the lazy"


def test_raw_decoder_is_the_rust_decode_and_gives_decodes_text(tok):
    """The fast path is taken for a plain tokenizers-backed tokenizer and returns exactly
    tokenizer.decode's text (special tokens kept or skipped, byte-fallback pieces); a
    tokenizer that cleans up spaces, or one without a Rust backend, keeps tokenizer.decode."""
    import random

    fast = raw_decoder(tok)
    assert fast == tok.backend_tokenizer.decode
    rng = random.Random(0)
    specials = list(tok.all_special_ids)
    for n in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(1 + n % 9)]
        for skip in (False, True):
            assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True
    try:
        assert raw_decoder(tok) == tok.decode
    finally:
        tok.clean_up_tokenization_spaces = False
    tok._decode = lambda *a, **k: "patched"  # an instance's own decoding wins
    try:
        assert raw_decoder(tok) == tok.decode
    finally:
        del tok._decode

    class Plain:
        def decode(self, ids, skip_special_tokens=False):
            return "x"

    p = Plain()
    assert raw_decoder(p) == p.decode
