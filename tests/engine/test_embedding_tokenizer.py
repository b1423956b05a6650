"""The encoder's tokenizer on all-MiniLM-L6-v2's tokenizer.json: the [CLS] ... [SEP] frame, no padding or
truncation left over from the file (it pads and cuts to 128), truncation of text and of ids alike
(the frame kept), and the reference's own ids (sentence-transformers' tokenizer, where installed)."""

from __future__ import annotations

import pytest

from engine.embedding.loader import load_encoder
from engine.embedding.tokenizer import EncoderTokenizer

pytestmark = pytest.mark.model

CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tok() -> EncoderTokenizer:
    enc = load_encoder(None, with_weights=False)
    return EncoderTokenizer(enc.tokenizer_json, enc.max_seq_length, enc.do_lower_case)


def long_text(words: int) -> str:
    return " ".join(f"word{i % 7} tree" for i in range(words // 2))


def test_inputs_are_framed_unpadded_and_uncut_unless_asked(tok):
    short, long = tok.encode(["Hello world", long_text(600)])
    assert short[0] == CLS and short[-1] == SEP and len(short) == 4
    assert len(long) > 256  # tokenizer.json's own truncation (128) is gone: the engine refuses or cuts
    assert tok.prefix_ids == [CLS] and tok.suffix_ids == [SEP]


def test_text_truncation_keeps_the_frame_and_matches_cutting_the_ids(tok):
    text = long_text(600)
    cut = tok.encode([text], truncate=True)[0]
    assert len(cut) == 256 and cut[0] == CLS and cut[-1] == SEP
    assert tok.truncate(tok.encode([text])[0]) == cut
    assert tok.truncate(cut) == cut  # already within: unchanged


def test_ids_without_the_frame_keep_their_first_ids(tok):
    ids = list(range(1000, 1300))
    assert tok.truncate(ids) == ids[:256]


def test_text_is_stripped_and_lowercased_as_the_reference_does(tok):
    assert tok.encode(["  Hello World  "]) == tok.encode(["hello world"])


def test_same_ids_as_sentence_transformers(tok, minilm_reference):
    model = minilm_reference
    texts = ["a", "  Spaced out  ", "[SEP] inside [CLS]", "Ünïcödé café 東京 🙂", long_text(300), long_text(1000)]
    features = model.tokenize(texts) if not hasattr(model, "preprocess") else model.preprocess(texts)
    for ours, ref, mask in zip(tok.encode(texts, truncate=True), features["input_ids"], features["attention_mask"]):
        assert ours == ref[: int(mask.sum())].tolist()
