"""The release's tokenizer, loaded as the reference loads it (``AutoTokenizer``), used through its fast backend.

``transformers`` may rebuild the pipeline of ``tokenizer.json`` (it does for Qwen3.5), so the reference's loader is
used, then the ``tokenizers`` backend encodes every prompt piece of a request in one call (the same ids as one
call per piece). The class checks that keep a release from choosing code or pipelines: docs/format.md §1.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from clef_local.errors import ReleaseError, one_line
from clef_local.formats.release import TOKENIZER_CONFIG, check_tokenizer_config

# What AutoTokenizer builds from an allowed tokenizer_class in transformers 5 (the Qwen classes; the plain
# tokenizers-backed class, of which PreTrainedTokenizerFast is an alias). transformers may substitute a class (for a
# qwen3_5 config it builds Qwen3_5Tokenizer whatever the file names), so the built one is checked too.
LOADED_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast", "Qwen3_5Tokenizer", "Qwen3_5TokenizerFast",
                            "PreTrainedTokenizerFast", "TokenizersBackend"})

log = logging.getLogger(__name__)

# Bytes of text per token assumed when a tokenizer's tokens cannot be bounded (ReleaseTokenizer.max_token_bytes);
# no real vocabulary has tokens this long.
FALLBACK_TOKEN_BYTES = 256
# How many times fewer UTF-8 bytes a normalizer can leave of a text, at most: NFC composes three Hangul jamo
# (9 bytes) into one syllable (3), NFKC/NFKD map 4-byte mathematical letters to one ASCII byte, Lowercase the
# 3-byte Kelvin sign. Prepend and ByteLevel only add. Any other (StripAccents, Strip, Replace, Precompiled) can
# delete text without bound.
NORMALIZER_SHRINK: dict[str, int] = {"NFC": 3, "NFD": 3, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1,
                                     "ByteLevel": 1}


class ReleaseTokenizer:
    """Tokenizes prompt pieces for :func:`clef_local.runtime.encoding.encode_request`."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ReleaseError(f"{path}: tokenizer.json is missing; a Clef release ships its tokenizer files")
        check_tokenizer_config(path / TOKENIZER_CONFIG)  # missing, auto_map, a class outside the format: refused
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (OSError, ValueError, TypeError) as exc:
            raise ReleaseError(f"{path}: the tokenizer cannot be loaded ({one_line(exc)})") from exc
        if type(tokenizer).__name__ not in LOADED_CLASSES:
            raise ReleaseError(f"{path}: transformers built a {type(tokenizer).__name__} from {TOKENIZER_CONFIG}; "
                               f"a Clef release's tokenizer is one of {', '.join(sorted(LOADED_CLASSES))}")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ReleaseError(f"{path}: {type(tokenizer).__name__} has no fast (tokenizers) backend")
        self._tokenizer = backend
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # Padding sits past the attention mask on the right, so any id works when none is declared.
        self.pad_token_id: int = pad if pad is not None else 0

    def encode_pieces(self, pieces: Sequence[str]) -> list[list[int]]:
        """Ids of each piece, tokenized on its own, with no special tokens added."""
        return [e.ids for e in self._tokenizer.encode_batch(list(pieces), add_special_tokens=False)]

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """At most how many bytes of UTF-8 text one token can stand for: ``tokens(text) >= bytes(text) / this``.

        It lets a request too large for the context be refused before it is tokenized (``RequestEncoder.check_size``):
        tokenizing megabytes only to fail would hold a thread for seconds and grow the process by gigabytes. The longest
        vocabulary token in bytes of the text it covers (a byte-level BPE token's characters are bytes: 81 for SmolLM2),
        times how far the normalizer can shrink text before the model sees it (:data:`NORMALIZER_SHRINK`: NFC composes
        three Hangul jamo, 9 bytes, into one 3-byte syllable).
        :data:`FALLBACK_TOKEN_BYTES` when the vocabulary cannot be listed or the normalizer may shrink text
        without bound (a ``Replace``, ``Strip`` or precompiled normalizer).
        """
        backend = self._tokenizer
        try:
            vocab = backend.get_vocab(with_added_tokens=False)
            added = [token.content for token in backend.get_added_tokens_decoder().values()]
        except (AttributeError, TypeError) as exc:  # not a tokenizers.Tokenizer: the conservative constant
            log.warning("cannot list the tokenizer's vocabulary (%s); assuming tokens of up to %d bytes", exc,
                        FALLBACK_TOKEN_BYTES)
            return FALLBACK_TOKEN_BYTES
        byte_level = _component_types(backend.decoder) == ["ByteLevel"]
        longest = max((len(token) if byte_level else len(token.encode("utf-8")) for token in vocab), default=1)
        longest = max(longest, *(len(text.encode("utf-8")) for text in added), 1)
        shrink = 1
        for kind in _component_types(backend.normalizer):
            factor = NORMALIZER_SHRINK.get(kind)
            if factor is None:
                log.warning("the tokenizer's %s normalizer may shrink text by any factor; assuming tokens of up to "
                            "%d bytes for size checks", kind, FALLBACK_TOKEN_BYTES)
                return max(FALLBACK_TOKEN_BYTES, longest)
            shrink *= factor
        return longest * shrink


def _component_types(part: Any) -> list[str]:
    """The ``type`` of a normalizer or decoder, or of each member of a ``Sequence`` (empty for none)."""
    if part is None:
        return []
    state = json.loads(part.__getstate__())  # tokenizers' own JSON form of the component
    members = state.get("normalizers") or state.get("decoders") if state.get("type") == "Sequence" else [state]
    return [str(member.get("type")) for member in members or []]
