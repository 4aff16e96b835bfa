"""The tokenizer for a `ModelSource`, as a transformers `PreTrainedTokenizerFast`.

Converting a GGUF vocabulary (token list + merges) into a fast tokenizer takes
seconds, so the result is saved once under the cache directory, keyed by the
GGUF file's path, size and mtime, and reloaded from there in a fraction of that.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from oasiskv.models.downloads import cache_dir
from oasiskv.models.loader import ModelSource

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def gguf_tokenizer_cache_path(gguf_path: Path) -> Path:
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    return cache_dir() / "tokenizers" / key


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerFast | None:
    """None when the source has no tokenizer (a dummy preset): the engine then takes token ids."""
    path = source.path
    if path is None:
        return None
    if path.is_dir():
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            if source.kind == "dummy":
                return None
            raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}")
        # AutoTokenizer keeps model-specific subclasses (all PreTrainedTokenizerFast in transformers 5).
        return AutoTokenizer.from_pretrained(path)
    return _load_gguf_tokenizer(path)


def _load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerFast:
    cached = gguf_tokenizer_cache_path(gguf_path)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    # The converter also carries over tokenizer.chat_template and bos/eos/unk/pad.
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    cached.parent.mkdir(parents=True, exist_ok=True)
    # Save into a temporary sibling and rename, so a concurrent or interrupted
    # writer never leaves a half-written cache entry behind.
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry is not
        tok.save_pretrained(tmp)
        tmp.rename(cached)
    except OSError:
        if not (cached / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
