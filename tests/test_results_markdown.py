"""Markdown is escaped like HTML: names from results files and the command line (models, files, classes, criteria)
reach leaderboard.md, report.md and train.py's report.md as typed, adding no markup, whatever characters they hold.
Read back by a CommonMark renderer with GitHub's tables (markdown-it-py, as GitHub reads them: a `\\|` in a cell is
a pipe), and by the HTML report's reader of the same Markdown (`inline_html`)."""

from __future__ import annotations

import html
import json
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import run_in_process
from tools.results.leaderboard import MARKDOWN_FILE, MODELS_FOLDER, build_leaderboard
from tools.results.markdown import code, escape, inline_html, markdown_table
from tools.results.report import cli as report_cli
from tools.training.evaluation import render_training_report

HOSTILE = ["<img src=x onerror=alert(1)>", "**b**", "a`b", "``x`` y `", "a|b\\|c\\", "# head", "[l](http://e)",
           "![i](x.png)", "1. x", "~~s~~", "- item", "a_b_c *d*", "&lt;b&gt;", "<https://e.org>", "x\\", " `pad` "]

# What the toolkit's own Markdown makes: anything else in the rendered page came from a name.
OWN_TAGS = {"h1", "h2", "h3", "p", "table", "thead", "tbody", "tr", "th", "td", "code", "strong", "em", "img"}


def render(markdown: str) -> str:
    markdown_it = pytest.importorskip("markdown_it")
    return markdown_it.MarkdownIt("gfm-like", {"linkify": False}).render(markdown)


class Rendered(HTMLParser):
    """The tags of a rendered page, its images' sources, and the text of each block (cell, paragraph, heading)."""

    BLOCKS = {"td", "th", "p", "h1", "h2", "h3"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.images: list[str] = []
        self.blocks: list[str] = []
        self._open: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag in self.BLOCKS:
            self._open.append("")

    def handle_endtag(self, tag):
        if tag in self.BLOCKS and self._open:
            self.blocks.append(self._open.pop())

    def handle_data(self, data):
        if self._open:
            self._open[-1] += data


def check_shown_as_typed(markdown: str, names: list[str], images: set[str]) -> Rendered:
    page = Rendered(render(markdown))
    assert page.tags <= OWN_TAGS, page.tags - OWN_TAGS
    assert set(page.images) <= images, page.images
    for name in names:
        assert any(name.strip() in block for block in page.blocks), (name, page.blocks)
    return page


@pytest.mark.parametrize("name", HOSTILE)
def test_escaped_text_and_code_spans_read_back_as_typed(name):
    markdown_it = pytest.importorskip("markdown_it")
    md = markdown_it.MarkdownIt("gfm-like", {"linkify": False})
    as_text = html.escape(name, quote=False).replace('"', "&quot;")  # how markdown-it writes text
    assert md.renderInline(escape(name)) == as_text
    assert md.renderInline(code(name)) == f"<code>{as_text}</code>"
    # the HTML report's reader of the same Markdown agrees
    assert inline_html(escape(name)) == html.escape(name)
    assert inline_html(code(name)) == f"<code>{html.escape(name)}</code>"
    # in a table cell, as GitHub splits cells (and trims them)
    cells = Rendered(render("\n".join(markdown_table(["a", "b"], [[escape(name), code(name)]], "ll")))).blocks
    assert cells[-2:] == [name.strip(), name]


def zoo_results(folder: Path, name: str, index: int) -> None:
    """A zoo results file (tools.zoo writes them under models/) for a model called `name`."""
    provenance = {"data": {"sha256": f"{index:064x}"}, "num_classes": 1000, "arch": name}
    payload = {"model": name, "source": f"file{name}", "weights": name,
               "weights_file_sha256": f"`{name}`{index:060x}",
               "in9": {"original": {"accuracy": 90.0 - index}, "mixed_same": {"accuracy": 80.0},
                       "mixed_rand": {"accuracy": 70.0}, "bg_gap": 10.0, "provenance": provenance},
               "challenge": {"challenge_accuracy": 20.0 + index, "criterion": name, "provenance": provenance}}
    (folder / MODELS_FOLDER).mkdir(parents=True, exist_ok=True)
    (folder / MODELS_FOLDER / f"model{index}.json").write_text(json.dumps(payload))


def test_the_leaderboard_shows_model_names_as_typed(tmp_path):
    for index, name in enumerate(HOSTILE):
        zoo_results(tmp_path, name, index)
    build_leaderboard(tmp_path, include_published=False)
    markdown = (tmp_path / MARKDOWN_FILE).read_text()
    check_shown_as_typed(markdown, HOSTILE, images={"leaderboard.png"})


def test_the_report_shows_names_from_its_results_files_as_typed(tmp_path, capsys):
    name = HOSTILE[0] + " " + HOSTILE[1] + " " + HOSTILE[2]
    provenance = {"arch": name, "checkpoint": f"/models/{name}.pt", "sha256": "a`b``c", name: name,
                  "data": {"files": name, "sha256": name}}
    challenge = {"challenge_accuracy": 50.0, "vulnerable": 1, "total": 2, "vulnerable_percent": 50.0,
                 "criterion": name, "provenance": provenance, "per_class": {name: {"vulnerable": 1, "total": 2}}}
    in9 = {"bg_gap": 1.0, "provenance": provenance, "original": {"accuracy": 50.0, "correct": name, "total": 2}}
    (tmp_path / "challenge.json").write_text(json.dumps(challenge))
    (tmp_path / "in9.json").write_text(json.dumps(in9))
    out = tmp_path / "report.md"
    code_, _, err = run_in_process(report_cli.main, ["--in9", str(tmp_path / "in9.json"), "--challenge",
                                                     str(tmp_path / "challenge.json"), "--output", str(out)], capsys)
    assert code_ == 0, err
    page = check_shown_as_typed(out.read_text(), [name, f"/models/{name}.pt", "a`b``c"], images=set())
    assert any(f"under the {name} criterion" in block for block in page.blocks)


def test_the_analysis_section_shows_stems_and_classes_as_typed():
    from tools.results.report import render_report  # noqa: PLC0415
    name = "<img src=x onerror=alert(1)>`**b**"
    entry = {"stem": name, "asr": 0.5, "index": 0, "image": "x.png"}
    info = {"fool_rate": 0.5, "backgrounds": name, "mean_asr": 0.5, "max_asr": 0.5, "asr_histogram": [1, 0],
            "top_backgrounds": [entry]}
    analysis = {"foregrounds": name, "backgrounds": 1, "top_k": name, "per_class": {name: info},
                "files": {"figure": "https://tracker.example/pixel.png"}}
    check_shown_as_typed(render_report(analysis=analysis), [name], images={"top_backgrounds.png"})


def test_the_training_report_shows_paths_and_names_as_typed(tmp_path):
    name = "<img src=x onerror=alert(1)>`**b**"
    config = SimpleNamespace(method_name="erm", train_variation="original", data_path=tmp_path / name, epochs=1,
                             batch_size=2, eval_data=tmp_path / name)
    start = SimpleNamespace(source=None, arch=name)
    result = SimpleNamespace(start=start, data={"files": 3, "sha256": "0" * 64}, steps=1, last_loss=1.0,
                             images_per_s=1.0, checkpoint=tmp_path / f"{name}.pt")
    trained = {"in9": {"original": {"accuracy": 50.0}, "bg_gap": 1.0}, "challenge": None}
    check_shown_as_typed(render_training_report(config, result, trained, None), [name, str(tmp_path / name)],
                         images=set())
