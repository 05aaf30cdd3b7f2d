"""Every figure the README's headline table quotes has its raw result in the repository.

docs/figures.md's "Where each figure comes from" table maps each quoted figure to the page that
quotes it, a JSON file (benchmarks/results/ or benchmarks/profiles/) and the key that holds it.
Each row is checked against both sides: the quoted text is on the page, the file exists and
names its command, commit, machine and date, and the value at the key, scaled and rounded as
quoted, is the quoted number. The README's headline table may quote no figure without a row."""
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def figure_rows():
    """The rows of docs/figures.md's mapping table: (quoted, page, file, key, scale)."""
    text = _read("docs/figures.md")
    section = text.split("## Where each figure comes from", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("quoted", "") or set(cells[0]) <= {"-"}:
            continue
        quoted, page, path, key, scale = (c.strip("`") for c in cells)
        rows.append((quoted, page, path, key, float(scale)))
    return rows


def value_at(doc, key):
    """``doc``'s value at a ``/``-separated key (list items by index)."""
    for part in key.split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def provenance(doc):
    """command, commit, machine, date of a results file (benchmarks/results/), or of a GPU
    check's file (benchmarks/profiles/: its env part; the command is in the folder's README)."""
    if "parts" in doc:
        env = doc["parts"]["env"]["result"]
        return {"command": "benchmarks/gpu_check.py", "commit": env["commit"], "machine": env["device_kind"],
                "date": env["date"]}
    return {k: doc.get(k) for k in ("command", "commit", "machine", "date")}


ROWS = figure_rows()


def test_the_mapping_table_is_there():
    assert len(ROWS) >= 8


@pytest.mark.parametrize("quoted, page, path, key, scale", ROWS, ids=[r[0] for r in ROWS])
def test_each_quoted_figure_is_on_its_page_and_in_its_raw_result(quoted, page, path, key, scale):
    assert quoted in _read(page), f"{page} no longer quotes {quoted!r}: update docs/figures.md"
    doc = json.loads(_read(path))
    assert all(provenance(doc).values()), (path, provenance(doc))
    shown = NUMBER.search(quoted).group(0).replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    assert round(float(value_at(doc, key)) * scale, decimals) == pytest.approx(float(shown), abs=1e-9), (
        quoted, path, key, value_at(doc, key))


def test_every_figure_of_the_readmes_headline_table_has_a_row():
    """Each bold figure in the README's "Headline figures" table is a row's quoted text."""
    readme = _read("README.md")
    table = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    bold = re.findall(r"\*\*([^*]+)\*\*", "\n".join(l for l in table.splitlines() if l.startswith("|")))
    mapped = {r[0] for r in ROWS if r[1] == "README.md"}
    assert bold and not [b for b in bold if b not in mapped], [b for b in bold if b not in mapped]
