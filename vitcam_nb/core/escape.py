"""Escaping of text that reaches HTML or markdown: everything from a model, a file or a user (model names,
tags, preprocessing, labels, prompts, module paths) renders literally and never as a tag, link, image,
emphasis or code span.

Markdown is escaped with character references (``&lt;``, ``&#42;``), not backslashes: every renderer
(CommonMark, GFM, mistune, marked, Python-Markdown) shows a reference as its character and none treats it as
syntax, while backslash escapes differ between them (Python-Markdown keeps ``\\<`` as a tag). ``$`` and ``\\``
are references inside an empty ``<span>``, which every one of them passes through: JupyterLab's MathJax reads
the rendered text, references decoded, and would typeset ``$x$`` or ``\\(x\\)`` and drop the backslash of
``\\$``, but never matches across an element.

Example:
    >>> escape_markdown('blocks.<l>.norm1 [x](javascript:y)')
    'blocks.&lt;l&gt;.norm1 &#91;x&#93;(javascript:y)'
    >>> escape_html('<img src=x onerror="y">')
    '&lt;img src=x onerror=&quot;y&quot;&gt;'
"""

from __future__ import annotations

import html
import re

__all__ = ["escape_html", "escape_markdown", "escape_mathtext"]

# Characters that open markdown or HTML syntax anywhere in a line: tags and entities (& < >), links and
# images ([ ]), emphasis and strikethrough (* ~), code spans (`), backslash escapes (\) and table cells (|).
# "$" and "\" also go inside an empty span: JupyterLab typesets the rendered page with MathJax, which reads
# "$...$", "\(...\)" and its escapes from the decoded text (a reference alone does not stop it, and "\$"
# would show as "$") but never matches across an element.
_INLINE = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "[": "&#91;", "]": "&#93;", "*": "&#42;", "~": "&#126;",
           "`": "&#96;", "\\": "<span>&#92;</span>", "|": "&#124;", "$": "<span>&#36;</span>"}
_INLINE_RE = re.compile("[" + re.escape("".join(_INLINE)) + "]")
# "_" emphasises only at a word boundary, so snake_case names stay readable in the markdown source.
_UNDERSCORE_RE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# Bare URLs, e-mail addresses and domains that GFM-style renderers (mistune's url plugin, marked) and linkify
# (markdown-it, as VS Code renders notebooks) turn into links: "://", "www.", "@" and the dot before a top-level
# domain (linkify's own list, and any two letters) lose their trigger character. "mailto:" and "xmpp:" links
# need an "@" too.
_AUTOLINK_RE = re.compile(r":(?=//)|(?<![A-Za-z0-9])(www)\.|@|(?<=[A-Za-z0-9-])\.(?=(?:biz|com|edu|gov|net|org|"
                          r"pro|web|xxx|aero|asia|coop|info|museum|name|shop|[a-z]{2})(?![A-Za-z0-9-]))",
                          re.IGNORECASE)
_AUTOLINK = {":": "&#58;", "@": "&#64;", ".": "&#46;"}
# What starts a block at the beginning of a line: heading, list item, thematic break, setext underline,
# ordered list item ("1." / "1)"). Leading whitespace is dropped (it would make an indented code block, and
# HTML does not show it).
_LINE_START_RE = re.compile(r"^[ \t]*(?:([#+\-=])|(\d+)([.)]))?", re.MULTILINE)


def _line_start(match: re.Match) -> str:
    if match.group(1):
        return f"&#{ord(match.group(1))};"
    if match.group(2):
        return f"{match.group(2)}&#{ord(match.group(3))};"
    return ""


def escape_markdown(text: object, *, inline: bool = False) -> str:
    """``text`` as markdown that renders literally: no tag, entity, link (bare URLs, e-mail addresses and
    domains included), image, emphasis, code span, table cell break or block (heading, list, code block) comes
    from it.
    ``inline=True`` also joins its lines with spaces (for a table cell, which a newline would end).

    Example:
        >>> escape_markdown("*a* <b> & _c_ snake_case")
        '&#42;a&#42; &lt;b&gt; &amp; &#95;c&#95; snake_case'
        >>> escape_markdown("# x\\n  - y\\n2. z")
        '&#35; x\\n&#45; y\\n2&#46; z'
        >>> escape_markdown("me@example.org blocks.0.norm1")
        'me&#64;example&#46;org blocks.0.norm1'
    """
    # Every line break (a lone "\r" ends a markdown line too) becomes "\n", or a space when inline.
    text = (" " if inline else "\n").join(str(text).splitlines())
    text = _INLINE_RE.sub(lambda m: _INLINE[m.group(0)], text)
    text = _UNDERSCORE_RE.sub("&#95;", text)
    text = _AUTOLINK_RE.sub(lambda m: f"{m.group(1)}&#46;" if m.group(1) else _AUTOLINK[m.group(0)], text)
    return _LINE_START_RE.sub(_line_start, text)


def escape_html(text: object) -> str:
    """``str(text)`` with ``& < > " '`` replaced by character references: safe as element text and inside a
    quoted attribute.

    Example:
        >>> escape_html("<b title='x'>")
        '&lt;b title=&#x27;x&#x27;&gt;'
    """
    return html.escape(str(text), quote=True)


def escape_mathtext(text: object) -> str:
    """``str(text)`` as matplotlib draws it literally: a class or file name with two ``$`` would otherwise be
    typeset as mathtext (``$x$`` as an italic x).

    Example:
        >>> escape_mathtext("price $5 to $10")
        'price \\\\$5 to \\\\$10'
    """
    return str(text).replace("$", r"\$")
