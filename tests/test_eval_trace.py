"""`zipage eval --trace`: the picture of a request's kept map over time (well-formed SVG, one row per
compression, every position's share as the map says), and the files a run writes for its samples."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from typer.testing import CliRunner

from kept_helpers import PIECES, PROMPT_TOKENS, dropping_map, everything_map, varied_map
from eval_fixtures import _one_thread, _private_cache  # noqa: F401 (autouse)
from zipage.cli.eval import common as ec
from zipage.cli.eval import needle
from zipage.cli.eval.kept_svg import GONE, Mark, colour, find_marks, kept_svg
from zipage.cli.eval.trace import Tracer, slug
from zipage.cli.main import app
from zipage.engine.loading.loader import resolve_model

SVG = "{http://www.w3.org/2000/svg}"


def rows_of(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)  # well-formed XML, or this raises
    assert root.tag == SVG + "svg"
    return [g for g in root.iter(SVG + "g") if g.get("class") == "row"]


def shares_drawn(row: ET.Element) -> list[float]:
    """Every position's share as the row's rectangles draw it (runs must tile the positions)."""
    shares = []
    for rect in row.iter(SVG + "rect"):
        start, end = int(rect.get("data-from")), int(rect.get("data-to"))
        assert start == len(shares) and end > start
        shares += [float(rect.get("data-share"))] * (end - start)
        assert rect.get("fill") == colour(float(rect.get("data-share")))
    return shares


def test_one_row_per_compression_with_every_share_as_the_map_says():
    n = len(PIECES)
    first = dropping_map(n - 4, {(layer, head): {2, 3} for layer in range(4) for head in range(2)})
    maps = [first, varied_map(compressions=2)]
    marks = find_marks(PIECES, [("needle", "magic number for lemon is 48213")], within=PROMPT_TOKENS)
    assert marks == [Mark("needle", 2, 8)]
    svg = kept_svg(maps, PIECES, PROMPT_TOKENS, marks, title="needle · default @ 25% · sample 0")
    rows = rows_of(svg)
    assert [int(r.get("data-compressions")) for r in rows] == [1, 2]
    for row, kmap in zip(rows, maps):
        assert shares_drawn(row) == pytest.approx(kmap.share(), abs=1e-4)
    assert shares_drawn(rows[1])[PROMPT_TOKENS + 1] == 0.0  # the answer's " magic": gone everywhere
    assert 'fill="%s"' % GONE in svg
    assert "needle: magic number for lemon is 48213." in svg and "answer →" in svg
    assert "needle 78%" in svg  # the first row: 4 of 6 layers lost " magic number", the rest held everywhere
    assert svg.count('class="mark"') == 1


def test_shares_use_every_layer_and_head():
    kmap = dropping_map(6, {(0, 0): {1}, (0, 1): {1, 2}, (1, 0): {2}})
    (row,) = rows_of(kept_svg([kmap], ["a"] * 6, 3))
    assert shares_drawn(row) == pytest.approx([1, 10 / 12, 10 / 12, 1, 1, 1], abs=1e-4)


def test_a_run_without_compression_says_so():
    svg = kept_svg([], PIECES, PROMPT_TOKENS, title="x")
    assert rows_of(svg) == [] and "no compression ran" in svg
    assert len(rows_of(kept_svg([everything_map(4)], ["<x>", "&", "b", "c"], 2))) == 1  # texts are escaped


def test_the_tracer_takes_a_map_after_every_compression(tiny_path):
    source = resolve_model(tiny_path)
    requests = [ec.Request(list(range(5, 60)), forced=list(range(60, 100)), free_tokens=8),
                ec.Request(list(range(3, 20)), free_tokens=30)]
    engine = ec.make_engine(source, 16, 1, 4, {}, "cpu")
    try:
        tracer = Tracer(engine)
        ec.drive(engine, requests, on_compressed=tracer.compressed)
        compressions = engine.totals["compressions"]
    finally:
        engine.close()
    taken = [m for maps in tracer.maps.values() for m in maps]
    assert compressions > 2 and len(taken) == compressions
    for maps in tracer.maps.values():
        assert [m.compressions for m in maps] == list(range(1, len(maps) + 1))
        assert all(m.num_positions > 0 for m in maps)


def test_eval_trace_writes_one_picture_per_sample(tiny_path, tmp_path):
    folder = tmp_path / "trace"
    result = CliRunner().invoke(app, ["eval", "recall", "--model", tiny_path, "--num-samples", "2", "--tokens", "48",
                                      "--budgets", "1", "--configurations", "default", "--block-size", "16",
                                      "--window", "4", "--json", str(tmp_path / "r.json"), "--trace", str(folder)])
    assert result.exit_code == 0, result.output
    pictures = sorted(folder.glob("*.svg"))
    assert [p.name for p in pictures] == ["recall-default-1-blocks-000.svg", "recall-default-1-blocks-001.svg"]
    rows = sum(len(rows_of(p.read_text())) for p in pictures)
    cell = json.loads((tmp_path / "r.json").read_text())["rows"][1]["by_budget"]["1 blocks"]
    assert rows == cell["compressions"] > 0
    assert all("fact: the access code for the" in p.read_text() for p in pictures)


def test_needle_pictures_mark_the_needle(tiny_path, tmp_path):
    needle.run(tiny_path, num_samples=1, lengths=[300], depths=[50], block_size=16, window=4,
               budgets=ec.parse_budgets("25%"), configurations=["sinks + recent"], trace=str(tmp_path))
    pictures = sorted(tmp_path.glob("needle-*.svg"))
    assert [p.name for p in pictures] == ["needle-sinks-recent-25pct-000.svg", "needle-sinks-recent-25pct-001.svg"]
    for picture in pictures:
        svg = picture.read_text()
        assert len(rows_of(svg)) == 1  # the prompt is compressed once, right after its prefill
        assert "needle: The special magic number for" in svg and 'class="mark"' in svg


def test_names_and_a_bad_folder():
    assert slug("sinks + recent") == "sinks-recent" and slug("25%") == "25pct" and slug("8 blocks") == "8-blocks"
    result = CliRunner().invoke(app, ["eval", "needle", "--model", "random:llama-tiny", "--trace", "/proc/no/such"])
    assert result.exit_code == 2 and "--trace /proc/no/such" in result.output
