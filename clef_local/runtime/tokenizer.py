"""The release's tokenizer, loaded the way the reference loads it, used through its fast backend.

``transformers`` does not always run the pipeline written in ``tokenizer.json``: for Qwen3.5 it rebuilds the
normalizer and pre-tokenizer from vocab and merges. So the tokenizer is loaded with ``AutoTokenizer`` (as the
reference's processor does), and its ``tokenizers`` backend encodes all prompt pieces of a request in one batch
call, with no special tokens added: the same ids as ``tokenizer(piece, add_special_tokens=False)`` per piece.

The release does not choose arbitrary code or pipelines: ``tokenizer_config.json`` must name a class of
:data:`clef_local.formats.release.TOKENIZER_CLASSES` and carry no ``auto_map`` (checked before transformers reads
it), transformers is told ``trust_remote_code=False``, and the class it builds must be one of :data:`LOADED_CLASSES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from clef_local.errors import ReleaseError
from clef_local.formats.release import TOKENIZER_CONFIG, check_tokenizer_config, one_line

# What AutoTokenizer builds from an allowed tokenizer_class in transformers 5 (the Qwen classes; the plain
# tokenizers-backed class, of which PreTrainedTokenizerFast is an alias). transformers may substitute a class (for a
# qwen3_5 config it builds Qwen3_5Tokenizer whatever the file names), so the built one is checked too.
LOADED_CLASSES = frozenset({"Qwen2Tokenizer", "Qwen2TokenizerFast", "Qwen3_5Tokenizer", "Qwen3_5TokenizerFast",
                            "PreTrainedTokenizerFast", "TokenizersBackend"})


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
