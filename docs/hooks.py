"""MkDocs hooks: the pages made at build time from the repository's other files.

- README.md is the home page (index.md).
- guides/*.py and examples/*.py, keras-io style scripts (top-level
  triple-quoted markdown between code), become pages of prose and python
  code blocks (examples/ as their docstring, then their code).
- bench/results/*.md, what `make bench` writes, become the pages under
  bench/ (its README.md, the findings, is bench/index.md); CHANGELOG.md is
  changelog.md.

Nothing generated is committed. Every page links to the others by their path
in the repository, as GitHub shows them (`[the guide](../guides/monitoring.py)`
in docs/, `[the site's page](docs/composing.md)` in the README), and
`on_page_markdown` rewrites each such link to the page that file became, so
one link works on GitHub and on the site.
"""

import ast
import inspect
import pathlib
import posixpath
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Repository path -> site path (src_uri), and back, for every page and asset.
TO_SITE = {}
TO_REPO = {}

LINK = re.compile(r"(\]\(|src=\")([^)\"\s]+)")


def script_to_markdown(path):
    """A keras-io style script as markdown: its top-level strings as prose, the code between as python blocks."""
    source = path.read_text()
    lines = source.splitlines()
    prose = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    ]
    parts, line = [], 0  # `line`: 0-based index of the first line not yet written
    for node in prose:
        parts.append(_code(lines[line : node.lineno - 1]))
        parts.append(inspect.cleandoc(node.value.value))
        line = node.end_lineno
    parts.append(_code(lines[line:]))
    text = "\n\n".join(part for part in parts if part)
    if not text.startswith("# "):  # examples open with a docstring, not a title
        text = f"# {path.name}\n\n{text}"
    return text + "\n"


def _code(lines):
    code = "\n".join(lines).strip("\n")
    return f"```python\n{code}\n```" if code.strip() else ""


def _generated():
    """Site path -> (repository path, markdown) of every generated page."""
    # The home page has the tabs to navigate by: its sidebar would list only itself.
    home = "---\nhide:\n  - navigation\n---\n\n" + (ROOT / "README.md").read_text()
    pages = {"index.md": ("README.md", home)}
    pages["changelog.md"] = ("CHANGELOG.md", (ROOT / "CHANGELOG.md").read_text())
    for folder in ("guides", "examples"):
        for path in sorted((ROOT / folder).glob("*.py")):
            pages[f"{folder}/{path.stem}.md"] = (f"{folder}/{path.name}", script_to_markdown(path))
    for path in sorted((ROOT / "bench" / "results").glob("*.md")):
        name = "index.md" if path.name == "README.md" else path.name
        pages[f"bench/{name}"] = (f"bench/results/{path.name}", path.read_text())
    return pages


def on_config(config):
    """Lists, under Performance, any report in bench/results that mkdocs.yml's nav does not name yet
    (`make bench` may add one), so that a new report is a page, not a --strict failure."""
    for section in config["nav"] or []:
        if isinstance(section, dict) and "Performance" in section:
            entries = section["Performance"]
            listed = {next(iter(e.values())) if isinstance(e, dict) else e for e in entries}
            for path in sorted((ROOT / "bench" / "results").glob("*.md")):
                site = "bench/index.md" if path.name == "README.md" else f"bench/{path.name}"
                if site not in listed:
                    entries.append({path.stem: site})
    return config


def on_files(files, config):
    TO_SITE.clear()
    TO_REPO.clear()
    docs = pathlib.Path(config["docs_dir"]).resolve().relative_to(ROOT).as_posix()
    for file in files:
        TO_SITE[f"{docs}/{file.src_uri}"] = file.src_uri
        TO_REPO[file.src_uri] = f"{docs}/{file.src_uri}"
    for site, (repo, markdown) in _generated().items():
        files.append(File.generated(config, site, content=markdown))
        TO_SITE[repo], TO_REPO[site] = site, repo
    TO_SITE["bench/results"] = "bench/index.md"  # the folder, as GitHub shows it
    return files


def on_page_markdown(markdown, page, config, files):
    repo = TO_REPO.get(page.file.src_uri)
    if repo is None:
        return markdown
    here = posixpath.dirname(page.file.src_uri)

    def rewrite(match):
        target = match.group(2)
        if re.match(r"^([a-z]+:|#|/)", target):
            return match.group(0)
        path, hash_, fragment = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(repo), path))
        site = TO_SITE.get(resolved)
        if site is None:
            return match.group(0)
        return match.group(1) + posixpath.relpath(site, here or ".") + hash_ + fragment

    return LINK.sub(rewrite, markdown)
