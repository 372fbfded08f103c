"""The site's build hooks (mkdocs.yml). MkDocs: the home page is README.md and the benchmarks page BENCHMARKS.md,
so each text has one source; their links are written for GitHub (README.md links ``docs/PAGE.md``, the pages link
``../BENCHMARKS.md``) and rewritten here to the site's own pages. Griffe (:class:`SphinxRoles`): fcsd's docstrings
name code with Sphinx roles, which the API reference shows as code."""

from __future__ import annotations

import re
from pathlib import Path

import griffe
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"index.md": "README.md", "benchmarks.md": "BENCHMARKS.md"}
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|obj|exc):`~?([^`]+)`")


def on_files(files, config):
    for page, source in SOURCES.items():
        files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri in SOURCES:  # a root file: docs/X.md is X.md here
        markdown = re.sub(r"\]\(docs/", "](", markdown)
        markdown = markdown.replace("](BENCHMARKS.md", "](benchmarks.md").replace("](README.md", "](index.md")
    else:  # a page: the root files are pages of the site
        markdown = markdown.replace("](../BENCHMARKS.md", "](benchmarks.md").replace("](../README.md", "](index.md")
    return markdown


class SphinxRoles(griffe.Extension):
    """``:func:`fcsd.x``` in a docstring becomes ```fcsd.x``` (inline code) in the API reference."""

    def on_instance(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
