"""A griffe extension (mkdocs.yml loads it): the package's docstrings as Google style reads them.

Two habits of the docstrings, kept because they read well in the source and
in `help()`, are not Google style, which griffe parses:

- an `Example:` section whose doctest is not indented under its title
  (`>>>` at the docstring's margin, after a blank line, as Keras writes
  them): indented, joined to its title and titled `Examples:` here (the
  section griffe reads doctests from), so the example renders as
  highlighted code, not as a paragraph;
- one `Args:` entry for several parameters (`real, fake: tensors of the same
  shape`), possibly wrapped onto a second line: one entry per parameter
  here, so each is matched against the signature (a parameter that is not
  in it is still a warning, and fails `mkdocs build --strict`).
"""

import re

import griffe

SECTION = re.compile(r"^(Args|Arguments|Attributes|Examples?|Notes?|Raises|Returns|Warnings?|Yields):\s*$")
# An `Args:` entry naming several parameters: "a, b: text" (names wrapped onto the next line end with ",").
NAMES = re.compile(r"^    (\w+(?:,\s*\w+)+):(.*)$")
WRAPPED = re.compile(r"^    \w+(?:,\s*\w+)*,\s*$")


def normalise(text):
    lines, out, section = text.split("\n"), [], None
    i = 0
    while i < len(lines):
        line = lines[i]
        header = SECTION.match(line)
        if header:
            section = header.group(1)
            if section in ("Example", "Examples"):
                line = "Examples:"  # griffe's doctest section; "Example:" is an admonition
                while i + 1 < len(lines) and not lines[i + 1].strip():
                    i += 1  # Google style reads a section from the line after its title
        elif section in ("Example", "Examples") and line.strip() and not line.startswith("    "):
            line = "    " + line
        elif section in ("Args", "Arguments"):
            while WRAPPED.match(line) and i + 1 < len(lines):
                i += 1
                line = line.rstrip() + " " + lines[i].strip()
            entry = NAMES.match(line)
            if entry:
                following = []
                while i + 1 < len(lines) and lines[i + 1].startswith("        "):
                    i += 1
                    following.append(lines[i])
                for name in re.split(r",\s*", entry.group(1)):
                    out.append(f"    {name}:{entry.group(2)}")
                    out.extend(following)
                i += 1
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class GoogleSections(griffe.Extension):
    def on_instance(self, *, node, obj, agent, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = normalise(obj.docstring.value)
