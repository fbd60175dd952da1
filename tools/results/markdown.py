"""Markdown tables, as every Markdown the toolkit writes lays them out (the report, the leaderboard, train.py's
before/after table)."""


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list], align: str) -> list[str]:
    """A Markdown table; `align` holds one character per column, l or r."""
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |",
            *("| " + " | ".join(_cell(v) for v in row) + " |" for row in rows)]
