"""Tokenizers: a dependency-free byte tokenizer and a wrapper around HF ``tokenizer.json`` files.

Both expose the same small :class:`Tokenizer` protocol. BOS/EOS are placed by the data
pipeline (``[bos] + tokens + [eos]`` per document), so ``encode`` never adds them itself.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from models.errors import ConfigError

if TYPE_CHECKING:
    import torch

# Special-token names tried in order. GPT-2 style files only have <|endoftext|>, which then
# serves as both BOS and EOS (that is how GPT-2 was trained).
BOS_CANDIDATES: tuple[str, ...] = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
EOS_CANDIDATES: tuple[str, ...] = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without BOS/EOS."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256 and EOS=257 (vocab 258).

    Needs no file and no training, so the built-in corpus works on every machine.
    """

    vocab_size: int = 258
    bos_id: int = 256
    eos_id: int = 257

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ints."""
        return list(text.encode("utf-8"))

    def encode_to_tensor(self, text: str) -> torch.Tensor:
        """Like :meth:`encode` but returns a 1-D uint8 tensor without a Python list.

        The built-in corpus is ~31 MB; going through ``list[int]`` would cost seconds.
        """
        import torch  # local: preparation workers tokenize without importing torch

        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.uint8)
        # np.frombuffer is read-only; copy so torch owns writable memory (no warning).
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``) behind the :class:`Tokenizer` protocol."""

    def __init__(self, path: str) -> None:
        """Load ``path`` and find its BOS/EOS among the usual special-token names."""
        from tokenizers import Tokenizer as _HFTokenizer  # local: the byte path needs no HF import

        if not os.path.isfile(path):
            raise ConfigError(
                f"data.tokenizer={path!r}: not 'byte' and no such file; "
                "pass data.tokenizer=byte or the path to an existing HF tokenizer.json"
            )
        try:
            self._tok = _HFTokenizer.from_file(path)
        except Exception as err:  # the Rust side raises plain Exception subclasses
            raise ConfigError(
                f"data.tokenizer={path!r}: not a readable HF tokenizer.json ({err}); "
                "pass a tokenizer.json saved by the `tokenizers` library or data.tokenizer=byte"
            ) from err
        self.path = path
        # Identity of the vocabulary and merges, not of the file's formatting or location.
        self.sha256: str = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id: int = self._find_special(BOS_CANDIDATES, "BOS")
        self.eos_id: int = self._find_special(EOS_CANDIDATES, "EOS")

    def _find_special(self, candidates: tuple[str, ...], what: str) -> int:
        for name in candidates:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return int(token_id)
        raise ConfigError(
            f"data.tokenizer={self.path!r} has no {what} token among {list(candidates)}; "
            f"add one of them as a special token to the tokenizer.json or use data.tokenizer=byte"
        )

    def id_to_token(self, token_id: int) -> str:
        """The token string of ``token_id`` (e.g. the BOS/EOS names an exported folder declares)."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the file's post-processor (which may add BOS) is skipped."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (parallel in Rust), without special tokens."""
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; anything else is a path to a HF ``tokenizer.json``."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)  # raises ConfigError for a missing or unreadable file


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Raise if a model with ``vocab_size`` embeddings cannot hold every id of ``tokenizer``."""
    if vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size={vocab_size} is smaller than the tokenizer's vocab_size="
            f"{tokenizer.vocab_size}; set model.vocab_size>={tokenizer.vocab_size} or use a smaller tokenizer"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer in prepared data: kind, sizes, specials and a content hash."""
    if isinstance(tokenizer, ByteTokenizer):
        kind, sha = "byte", hashlib.sha256(b"meshwright-byte-v1").hexdigest()
    else:
        kind, sha = type(tokenizer).__name__, getattr(tokenizer, "sha256", None)
    return {
        "kind": kind,
        "spec": getattr(tokenizer, "path", "byte"),
        "vocab_size": int(tokenizer.vocab_size),
        "bos_id": int(tokenizer.bos_id),
        "eos_id": int(tokenizer.eos_id),
        "sha256": sha,
    }


def encode_documents(
    tokenizer: Tokenizer, texts: Sequence[str], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """``[bos] + encode(t) + [eos]`` of every text, concatenated: (flat tokens, per-document lengths).

    The byte tokenizer never builds Python int lists; HF tokenizers encode the whole batch in
    parallel in Rust; any other tokenizer falls back to ``encode`` one text at a time.
    """
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if isinstance(tokenizer, ByteTokenizer):
        encoded: list[Any] = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        encode_batch = getattr(tokenizer, "encode_batch", None)
        encoded = (
            encode_batch(list(texts)) if encode_batch is not None else [tokenizer.encode(t) for t in texts]
        )
    lengths = np.fromiter((len(x) + 2 for x in encoded), dtype=np.int64, count=len(encoded))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for ids, n in zip(encoded, lengths.tolist()):
        flat[pos] = bos
        flat[pos + 1 : pos + n - 1] = ids
        flat[pos + n - 1] = eos
        pos += n
    return flat, lengths
