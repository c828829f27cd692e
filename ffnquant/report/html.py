"""A self-contained HTML page from a report's Markdown (inline CSS, plots as data URIs)."""

from __future__ import annotations

import base64
import html
import re
from typing import Mapping

from ..errors import FFNQuantError
from .markdown import PLOT_DIR

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1300px;
       padding: 0 1em; color: #1f2328; line-height: 1.45; }
h1 { border-bottom: 2px solid #d0d7de; padding-bottom: .3em; }
h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 2em; }
code { background: #f6f8fa; padding: .1em .3em; border-radius: 4px; font-size: 90%; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
tr:nth-child(even) td { background: #fbfcfd; }
td strong { color: #b42318; }
img { max-width: 100%; border: 1px solid #eee; margin: .5em 0; }
details { margin: 1em 0; }
"""


def render_html(markdown_text: str, plots: Mapping[str, bytes], title: str = "ffnquant report") -> str:
    """A self-contained HTML page from the Markdown: inline CSS, images as base64 data URIs."""
    # markdown-it-py (a dependency of rich) is a CommonMark-compliant renderer with GFM tables.
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    body = md.render(markdown_text)

    def embed(match: re.Match) -> str:
        name = match.group(1)
        data = plots.get(name)
        if data is None:
            raise FFNQuantError(f"report HTML refers to plot {name!r} that was not rendered")
        return 'src="data:image/png;base64,' + base64.b64encode(data).decode("ascii") + '"'

    body = re.sub(r'src="' + re.escape(PLOT_DIR) + r'/([^"]+)"', embed, body)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n{body}</body>\n</html>\n"
    )
