"""The built-in tokenizer (``actors.engine.tokenizer``) in Hugging Face format, for external load testers.

AIPerf, guidellm and vLLM's benchmark load a tokenizer by Hugging Face name or folder to size prompts and
count tokens; offline they cannot download one, and another model's tokenizer would count differently
from kvmesh. ``export_hf`` writes ``tokenizer.json`` (the ``tokenizers`` library's format),
``tokenizer_config.json``, ``special_tokens_map.json`` and ``config.json`` such that:

- The pre-tokenizer is kvmesh's own cut: ``\\s*\\S+|\\s+`` (each word with its leading whitespace), then
  pieces of at most ``MAX_PIECE`` characters. So any text has the same number of tokens in both.
- The vocabulary (a ``WordLevel`` model) holds the pieces " " + 1 to 3 lowercase letters under the id the
  built-in tokenizer gives them (pieces whose id another piece took are left out: one id, one piece); every
  other piece maps to the unknown token, still one token. Ids agree wherever the piece is in the vocabulary.
- The decoder concatenates pieces (``Fuse``): every vocabulary piece starts with a space and is at most 4
  characters, so text a load tester builds by decoding ids re-encodes, in kvmesh, to exactly as many tokens.

Invariant: ``len(hf.encode(t)) == len(Tokenizer.encode(t))`` for any text ``t`` (tested).

``install_in_hf_cache`` also lays the files out as a cached Hub repository (``<HF_HOME>/hub/models--<org>--
<name>/snapshots/<revision>/``, ``refs/main``): some tools resolve a tokenizer through the Hub cache even when
given a local folder (AIPerf 0.13's prompt workers run with ``HF_HUB_OFFLINE=1`` and look a name up in the
cache only), and with ``HF_HOME`` pointed there and ``HF_HUB_OFFLINE=1`` they load it by that repo name.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import string
from pathlib import Path
from typing import Any

from actors.engine.tokenizer import MAX_PIECE, RESERVED, Tokenizer

SPECIALS = {0: "<pad>", 1: "<s>", 2: "</s>"}
UNK = " unk"


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Piece -> id, as the built-in tokenizer assigns them (module docstring)."""
    tok = Tokenizer(vocab_size)
    out: dict[str, int] = {}
    taken: set[int] = set(SPECIALS)
    pieces = [UNK] + [" " + "".join(p) for n in range(1, MAX_PIECE) for p in
                      itertools.product(string.ascii_lowercase, repeat=n)]
    for piece in pieces:
        ids = tok.encode(piece)
        if len(ids) != 1 or ids[0] in taken:
            continue
        taken.add(ids[0])
        out[piece] = ids[0]
    return out


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    vocab = {**{v: k for k, v in SPECIALS.items()}, **vocabulary(vocab_size)}
    split = [{"type": "Split", "pattern": {"Regex": r"\s*\S+|\s+"}, "behavior": "Isolated", "invert": False},
             {"type": "Split", "pattern": {"Regex": r"[\s\S]{1," + str(MAX_PIECE) + "}"}, "behavior": "Isolated",
              "invert": False}]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in SPECIALS.items()],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": split},
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": UNK},
    }


def export_hf(folder: Path, vocab_size: int = 32000, max_context: int = 131072) -> list[Path]:
    """Write the tokenizer files into ``folder`` (created); returns their paths."""
    if vocab_size <= RESERVED + 1:
        raise ValueError(f"vocab_size must exceed {RESERVED + 1}")
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "tokenizer.json": tokenizer_json(vocab_size),
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_context,
                                  "clean_up_tokenization_spaces": False, "add_bos_token": False,
                                  "add_eos_token": False, "bos_token": SPECIALS[1], "eos_token": SPECIALS[2],
                                  "pad_token": SPECIALS[0], "unk_token": UNK},
        "special_tokens_map.json": {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "pad_token": SPECIALS[0],
                                    "unk_token": UNK},
        "config.json": {"model_type": "llama", "vocab_size": vocab_size, "max_position_embeddings": max_context,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                        "_kvmesh": "tokenizer-only export of kvmesh's built-in tokenizer (no weights)"},
    }
    out = []
    for name, obj in files.items():
        p = folder / name
        p.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")
        out.append(p)
    return out


def install_in_hf_cache(folder: Path, hf_home: Path, repo: str = "kvmesh/builtin-tokenizer") -> Path:
    """Copy the exported files in ``folder`` into ``hf_home``'s Hub cache as ``repo`` (see the module
    docstring); returns the snapshot folder. The revision is a digest of the files, so a re-export that
    changes nothing lands in the same snapshot."""
    org, _, name = repo.partition("/")
    if not org or not name or "/" in name:
        raise ValueError(f"repo must be 'org/name', got {repo!r}")
    files = sorted(p for p in folder.iterdir() if p.is_file())
    if not any(p.name == "tokenizer.json" for p in files):
        raise ValueError(f"{folder} holds no tokenizer.json (run the export first)")
    digest = hashlib.sha1(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()
    base = hf_home / "hub" / f"models--{org}--{name}"
    snap = base / "snapshots" / digest
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        shutil.copyfile(p, snap / p.name)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(digest)
    return snap
