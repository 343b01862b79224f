"""The Hugging Face export of the built-in tokenizer: files, vocabulary ids as kvmesh assigns them, and
the pre-tokenizer's cut, which is kvmesh's own (the count check with the real ``tokenizers`` library
runs in tests/integration/test_aiperf.py, where AIPerf's virtualenv provides it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.engine.hf_export import UNK, export_hf, vocabulary
from actors.engine.tokenizer import Tokenizer
from run_cluster import main


def test_export_writes_hugging_face_files(tmp_path: Path) -> None:
    assert main(["tokenizer", "export", str(tmp_path / "tok")]) == 0
    names = {p.name for p in (tmp_path / "tok").iterdir()}
    assert names == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"}
    tj = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    assert tj["model"]["type"] == "WordLevel" and tj["model"]["unk_token"] == UNK
    assert tj["decoder"] == {"type": "Fuse"}
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["clean_up_tokenization_spaces"] is False and cfg["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_vocabulary_ids_are_kvmesh_ids_one_piece_per_id() -> None:
    tok = Tokenizer(32000)
    vocab = vocabulary(32000)
    assert len(vocab) > 10_000 and UNK in vocab
    assert len(set(vocab.values())) == len(vocab)
    for piece, tid in list(vocab.items())[::97]:
        assert tok.encode(piece) == [tid] and piece.startswith(" ") and len(piece) <= 4


def test_small_vocabulary_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        export_hf(tmp_path, vocab_size=10)
