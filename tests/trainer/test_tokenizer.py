"""Tokenizers: byte round trips, HF tokenizer.json loading and BOS/EOS detection (no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from models.errors import ConfigError
from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer, check_vocab_size

TEXTS = [
    "def main():\n    return 42\n",
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld — ünïcode ✓ 日本語",
]


def make_hf_tokenizer(path: Path, special_tokens: list[str], *, bos_post_processor: bool = False) -> str:
    """Train a tiny byte-level BPE on TEXTS and save it as tokenizer.json; returns the path."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 4, trainer=trainer)
    if bos_post_processor:  # like Llama 3's file: the post-processor prepends BOS
        bos = special_tokens[0]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    tok.save(str(path))
    return str(path)


# ---------------------------------------------------------------------------- byte


def test_byte_round_trip_including_non_ascii() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    for text in [*TEXTS, "", "\x00\n\t"]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text


def test_byte_encode_to_tensor_matches_encode() -> None:
    tok = ByteTokenizer()
    for text in [*TEXTS, ""]:
        t = tok.encode_to_tensor(text)
        assert t.dtype == torch.uint8 and t.dim() == 1
        assert t.tolist() == tok.encode(text)


def test_byte_decode_skips_specials_and_replaces_bad_utf8() -> None:
    tok = ByteTokenizer()
    assert tok.decode([256, *b"ab", 257]) == "ab"
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    assert tok.decode(torch.tensor([104, 105])) == "hi"


# ------------------------------------------------------------------------------ HF


def test_hf_round_trip_and_bos_eos(tmp_path: Path) -> None:
    path = make_hf_tokenizer(tmp_path / "tokenizer.json", ["<s>", "</s>", "<unk>"])
    tok = build_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    raw = RawTokenizer.from_file(path)
    assert tok.bos_id == raw.token_to_id("<s>")
    assert tok.eos_id == raw.token_to_id("</s>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.bos_id not in ids and tok.eos_id not in ids
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text  # specials dropped
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_hf_encode_skips_post_processor_bos(tmp_path: Path) -> None:
    """The data pipeline adds BOS itself; the file's template must not add a second one."""
    path = make_hf_tokenizer(
        tmp_path / "tok.json", ["<|begin_of_text|>", "<|end_of_text|>"], bos_post_processor=True
    )
    tok = HFTokenizer(path)
    raw = RawTokenizer.from_file(path)
    assert raw.encode("hello").ids[0] == tok.bos_id  # the file itself would prepend BOS
    assert tok.bos_id not in tok.encode("hello")


def test_hf_gpt2_style_single_special_is_bos_and_eos(tmp_path: Path) -> None:
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tok.json", ["<|endoftext|>"]))
    assert (
        tok.bos_id
        == tok.eos_id
        == RawTokenizer.from_file(str(tmp_path / "tok.json")).token_to_id("<|endoftext|>")
    )


def test_hf_without_bos_eos_raises(tmp_path: Path) -> None:
    path = make_hf_tokenizer(tmp_path / "nospecial.json", ["<pad>"])
    with pytest.raises(ConfigError, match="nospecial.json"):
        build_tokenizer(path)


def test_missing_or_corrupt_tokenizer_file_raises(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ConfigError, match="nope"):
        build_tokenizer(missing)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json"):
        build_tokenizer(str(bad))
    with pytest.raises(ConfigError):
        build_tokenizer("")
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)


def test_check_vocab_size() -> None:
    check_vocab_size(ByteTokenizer(), 258)
    check_vocab_size(ByteTokenizer(), 320)
    with pytest.raises(ConfigError, match="vocab_size=100"):
        check_vocab_size(ByteTokenizer(), 100)
