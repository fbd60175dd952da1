"""Markdown as every Markdown file the toolkit writes sets it: tables, and text from outside the toolkit (names
from results files or the command line) passed through `escape` or `code` so it shows as typed and adds no markup.
`inline_html` renders the little inline Markdown these files use as HTML, for the pieces the HTML report shares."""

from __future__ import annotations

import html
import re
import string

# Inline markup in CommonMark and GitHub's Markdown: emphasis, code, links and images, raw HTML and autolinks,
# strikethrough, table cells, math, and the escape itself: each such character is escaped with a backslash (CommonMark
# allows one before any ASCII punctuation). Two are escaped only where they could mean something: "_" unless between
# two letters or digits (where it can neither open nor close emphasis: snake_case names stay as they are), "&" where
# it starts what reads as an entity ("&lt;").
_INLINE = re.compile(r"[\\`*\[\]<~|$]|(?<![^\W_])_|_(?![^\W_])|&(?=#?\w+;)")
# A block marker where a line starts: a heading ("#" to "######"), a list item ("-", "+", "1." or "1)") each before a
# space or the end, a setext underline or thematic break (a line of "=" or "-"). "*" and "_" are escaped anyway;
# ">" (a block quote) is escaped where it starts a line, with these.
_LINE_START = re.compile(r"^\s*(?:>|#{1,6}(?=\s|$)|[-+](?=\s|$)|\d{1,9}(?=[.)](?:\s|$))|[-=](?=[-=\s]*$))")
_PUNCTUATION = set(string.punctuation)


def _one_line(value) -> str:
    return re.sub(r"[\r\n]+", " ", str(value))


def escape(value) -> str:
    """`value` as Markdown text that shows exactly as typed: markup characters backslash-escaped, line breaks made
    spaces (a name cannot start a block of its own), a leading block marker escaped."""
    text = _INLINE.sub(lambda m: "\\" + m.group(), _one_line(value))
    match = _LINE_START.match(text)
    if match:  # "# x", "- x", "---": escape the marker; "1. x": its dot ("1\\. x")
        at = match.end() if match.group().rstrip()[-1:].isdigit() else match.end() - len(match.group().lstrip())
        text = f"{text[:at]}\\{text[at:]}"
    return text


def code(value) -> str:
    """`value` as a Markdown code span: fenced by one backtick more than its longest run of backticks, and padded
    with a space where it begins or ends with a backtick (or a space, which CommonMark would strip)."""
    text = _one_line(value)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    if text.startswith(("`", " ")) or text.endswith(("`", " ")):
        text = f" {text} "
    return f"{fence}{text}{fence}"


def destination(target) -> str:
    """A link's or image's destination read as the one path it is (in angle brackets where needed)."""
    target = _one_line(target)
    if re.fullmatch(r"[^\s()<>\\]+", target):
        return target
    return "<" + re.sub(r"([<>\\])", r"\\\1", target) + ">"


def _cell(value) -> str:
    """A table cell, every pipe escaped (GitHub's tables read `\\|` as a pipe, in code spans too)."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list], align: str) -> list[str]:
    """A Markdown table of Markdown cells; `align` holds l or r per column."""
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(_cell(h) for h in header) + " |", "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]


def inline_html(markdown: str) -> str:
    """The inline Markdown the toolkit writes (code spans of any fence, backslash escapes) as HTML; any other
    character, markup characters included, is text."""
    out, i, n = [], 0, len(markdown)
    while i < n:
        c = markdown[i]
        if c == "\\" and i + 1 < n and markdown[i + 1] in _PUNCTUATION:
            out.append(html.escape(markdown[i + 1]))
            i += 2
            continue
        if c == "`":
            run = len(markdown[i:]) - len(markdown[i:].lstrip("`"))
            close = re.compile(rf"(?<!`)`{{{run}}}(?!`)").search(markdown, i + run)
            if close:
                content = markdown[i + run:close.start()]
                if len(content) > 1 and content.startswith(" ") and content.endswith(" ") and content.strip():
                    content = content[1:-1]
                out.append(f"<code>{html.escape(content)}</code>")
                i = close.end()
                continue
            out.append(html.escape(markdown[i:i + run]))
            i += run
            continue
        out.append(html.escape(c))
        i += 1
    return "".join(out)
