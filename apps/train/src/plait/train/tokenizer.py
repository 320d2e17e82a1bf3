"""Tokenizers: bytes (the download-free default) or a Hugging Face ``tokenizers`` file or model directory.

``data.tokenizer: bytes`` maps a document to its UTF-8 bytes (ids 0-255) and uses 256 as the
end-of-document token. Any other value is a local ``tokenizer.json`` or a directory holding one
(an HF model directory; its ``tokenizer_config.json`` names the EOS token), loaded with the
``tokenizers`` package; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = ["BYTE_EOS", "ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

BYTE_EOS = 256
"""End-of-document id of the byte tokenizer."""
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    """Number of ids the tokenizer can produce (the model's vocabulary must be at least this)."""
    eos_id: int

    def encode(self, doc: bytes) -> np.ndarray:
        """int32 ids of one UTF-8 document (no EOS, no special tokens)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, EOS 256."""

    name = "bytes"
    vocab_size = 257
    eos_id = BYTE_EOS

    def encode(self, doc: bytes) -> np.ndarray:
        return np.frombuffer(doc, dtype=np.uint8).astype(np.int32)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from a local ``tokenizer.json``."""

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError:
            raise ValueError(
                f"data.tokenizer {str(path)!r} needs the `tokenizers` package; install it or use "
                "data.tokenizer: bytes"
            ) from None
        root = Path(path)
        file = root / "tokenizer.json" if root.is_dir() else root
        if not file.is_file():
            raise ValueError(
                f"data.tokenizer {str(path)!r} is neither a tokenizer.json file nor a directory holding one "
                "(give a local path; nothing is downloaded)"
            )
        try:
            self._tok = _HF.from_file(str(file))
        except Exception as err:  # tokenizers raises its own Exception subclass for a bad file
            raise ValueError(f"data.tokenizer {str(file)!r} cannot be read: {err}") from None
        self.name = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = eos_token or _configured_eos(file.parent)
        candidates = [eos] if eos else [t for t in _EOS_NAMES if self._tok.token_to_id(t) is not None][:1]
        eos_id = self._tok.token_to_id(candidates[0]) if candidates else None
        if eos_id is None:
            raise ValueError(
                f"data.tokenizer {str(file)!r} has no end-of-document token "
                f"{'named ' + repr(eos) if eos else 'among ' + ', '.join(_EOS_NAMES)}; set data.eos_token"
            )
        self.eos_id = int(eos_id)

    def encode(self, doc: bytes) -> np.ndarray:
        text = doc.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def _configured_eos(directory: Path) -> str | None:
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("eos_token")
    if isinstance(value, dict):  # older files store an AddedToken as a mapping
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``bytes`` or a local tokenizer path (see the module docstring)."""
    if spec == "bytes":
        if eos_token is not None:
            raise ValueError("data.eos_token is only read with a tokenizer file, not data.tokenizer: bytes")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token)
