"""The tokenizer and generation files of an exported Hugging Face folder, so that the ecosystem's
tools (``transformers.AutoTokenizer`` / ``pipeline``, lm-evaluation-harness) read our exports.

- The byte tokenizer (``data.tokenizer=byte``) becomes a real ``tokenizers`` file: a byte-level
  BPE with the 256 bytes as ids 0..255 (GPT-2's byte-to-character alphabet, no merges),
  ``<|begin_of_text|>`` = 256 (BOS) and ``<|end_of_text|>`` = 257 (EOS), exactly the ids of
  ``trainer.data.tokenizer.ByteTokenizer``. Its post-processor prepends BOS when special tokens
  are asked for (``tokenizer(text)``), as a Llama tokenizer does and as our data pipeline and
  ``trainer.generate`` do (``[bos] + encode(text)``); ``tokenizer_config.json`` sets
  ``split_special_tokens`` so that a document containing the literal text ``<|end_of_text|>``
  is still encoded byte by byte, as ours is.
- A run with a HF ``tokenizer.json`` ships that file and the tokenizer files found beside it
  (``tokenizer_config.json``, ``special_tokens_map.json``, ...); without a
  ``tokenizer_config.json`` there, one naming the BOS/EOS tokens our tokenizer found is written.
- ``generation_config.json``: BOS / EOS (and EOS as the padding id) for ``generate``.

Plain JSON through the ``tokenizers`` library (a core dependency): no ``transformers`` import.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

from trainer.data.tokenizer import ByteTokenizer, HFTokenizer

__all__ = ["BYTE_BOS", "BYTE_EOS", "byte_level_tokenizer", "write_tokenizer_files"]

BYTE_BOS = "<|begin_of_text|>"
BYTE_EOS = "<|end_of_text|>"
# Files a Hugging Face tokenizer folder may hold besides tokenizer.json (copied when present).
_TOKENIZER_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map (``bytes_to_unicode``), the alphabet the
    ``tokenizers`` ByteLevel pre-tokenizer maps bytes to: printable Latin-1 bytes stand for
    themselves, the others are shifted to U+0100 onward. Index = byte value."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in kept}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` with the ids of ``ByteTokenizer`` (bytes 0..255, BOS 256, EOS 257)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte_tok = ByteTokenizer()
    vocab = {char: b for b, char in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    # use_regex=False: no word splitting (without merges it cannot change the ids).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(BYTE_BOS, special=True, normalized=False),
            AddedToken(BYTE_EOS, special=True, normalized=False),
        ]
    )
    if (tok.token_to_id(BYTE_BOS), tok.token_to_id(BYTE_EOS)) != (byte_tok.bos_id, byte_tok.eos_id):
        raise RuntimeError("the byte-level tokenizer's special ids differ from ByteTokenizer's")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BYTE_BOS} $A",
        pair=f"{BYTE_BOS} $A {BYTE_BOS} $B",
        special_tokens=[(BYTE_BOS, byte_tok.bos_id)],
    )
    return tok


def _tokenizer_config(bos: str, eos: str, max_len: int, **extra: Any) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,  # batching pads with EOS (ignored by the attention mask)
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        **extra,
    }


def write_tokenizer_files(out_dir: str, tokenizer: Optional[str], *, max_len: int) -> list[str]:
    """Write the tokenizer files and ``generation_config.json`` of ``tokenizer`` (``"byte"`` or a
    path to a HF ``tokenizer.json``) into the HF folder ``out_dir``; return the file names written.
    None (the run's tokenizer file has gone since) writes nothing: the weights are still exported."""
    if tokenizer is None:
        return []
    files: list[str] = []
    if tokenizer == "byte":
        byte_tok = ByteTokenizer()
        byte_level_tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
        _write_json(
            os.path.join(out_dir, "tokenizer_config.json"),
            _tokenizer_config(BYTE_BOS, BYTE_EOS, max_len, split_special_tokens=True),
        )
        _write_json(
            os.path.join(out_dir, "special_tokens_map.json"),
            {"bos_token": BYTE_BOS, "eos_token": BYTE_EOS, "pad_token": BYTE_EOS},
        )
        files += ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
        bos_id, eos_id = byte_tok.bos_id, byte_tok.eos_id
    else:
        hf_tok = HFTokenizer(tokenizer)
        shutil.copyfile(tokenizer, os.path.join(out_dir, "tokenizer.json"))
        files.append("tokenizer.json")
        source = os.path.dirname(os.path.abspath(tokenizer))
        for name in _TOKENIZER_SIDE_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
                files.append(name)
        if "tokenizer_config.json" not in files:
            bos, eos = hf_tok.id_to_token(hf_tok.bos_id), hf_tok.id_to_token(hf_tok.eos_id)
            # Our HFTokenizer never adds specials itself; the file's own post-processor decides.
            config = _tokenizer_config(bos, eos, max_len)
            del config["add_bos_token"], config["add_eos_token"]
            _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
            files.append("tokenizer_config.json")
        bos_id, eos_id = hf_tok.bos_id, hf_tok.eos_id
    _write_json(
        os.path.join(out_dir, "generation_config.json"),
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id},
    )
    return files + ["generation_config.json"]


def _write_json(path: str, value: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
