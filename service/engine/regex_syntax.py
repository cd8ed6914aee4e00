"""A JSON schema's patterns in outlines-core's regex syntax (Rust's `regex` crate), read piece by
piece: what json_schema.py checks and what grammar.py's `schema_regex` rewrites.

Read me first, the traps:
- Rust's `\\d` and `\\w` are Unicode (`\\d` takes '٣', `\\w` 'é'), JSON Schema's (ECMA-262's) are
  ASCII: `ascii_classes` writes them as [0-9] and [A-Za-z0-9_] (outlines-core's own `format: date`
  is `\\d{4}`-...).
- Rust nests classes (`[a[^b]]`) and has class set operations (`&&`, `--`, `~~`) where Python's
  `re` and ECMA-262 read literal characters: such a pattern cannot be checked (`unchecked`).
- `\\p{...}` (Unicode properties: categories, scripts, binary properties) are Rust's; Python's `re`
  has none. `checkable` writes each as the class of the characters of ESCAPED it holds (asked of
  outlines-core itself), plus 'a', which keeps the class non-empty and matches nothing escaped.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterator

ESCAPED = '"\\' + "".join(map(chr, range(0x20)))           # what JSON writes escaped in a string
ASCII = {"d": "0-9", "w": "A-Za-z0-9_"}                    # ECMA-262's \d and \w
BRACED = ("p", "P", "x", "u")                               # escapes that may take {...}


class Unchecked(ValueError):
    """A pattern whose characters cannot be told (its message says why)."""


def pieces(pattern: str) -> Iterator[tuple[str, int]]:
    """Each escape (`\\d`, `\\p{L}`, `\\pL`, `\\x{41}`) or other character of `pattern`, with the
    depth of character classes it is in (a class's own '[' and ']' count as inside it)."""
    depth, i, opened = 0, 0, -1
    while i < len(pattern):
        c, end = pattern[i], i + 1
        if c == "\\":
            end = i + 2
            if pattern[i + 1:end] in BRACED and pattern[end:end + 1] == "{":
                end = pattern.find("}", end) + 1 or len(pattern)
            elif pattern[i + 1:end] in ("p", "P"):
                end += 1
        elif c == "[":
            depth, opened = depth + 1, i
        elif c == "]" and depth and not (i == opened + 1 or (i == opened + 2 and pattern[i - 1] == "^")):
            yield c, depth
            depth, i = depth - 1, end
            continue
        yield pattern[i:end], depth
        i = end


def ascii_classes(regex: str) -> str:
    """`regex` with `\\d`, `\\w`, `\\D`, `\\W` as ECMA-262's ASCII classes (in a class, its
    members; `\\D` and `\\W` there a nested negated class, which Rust's syntax allows)."""
    out = []
    for piece, depth in pieces(regex):
        name = piece[1:].lower() if len(piece) == 2 and piece[0] == "\\" else ""
        if name not in ASCII:
            out.append(piece)
        elif piece[1].islower():
            out.append(ASCII[name] if depth else f"[{ASCII[name]}]")
        else:
            out.append(f"[^{ASCII[name]}]")
    return "".join(out)


def anchored(pattern: str) -> str:
    """`pattern` as outlines-core must be given it to match a whole string: `^(?:...)$`. It strips
    a leading '^' and a trailing '$' only when both are there, then writes the rest between the
    string's quotes as is: `cat|dog` became `"cat|dog"`, which takes `"cat` (not JSON), `^a\\$` lost
    its escaped '$'. A JSON Schema pattern searches: a string it matches whole is one it takes."""
    parts = list(pieces(pattern))
    parts = parts[1:] if parts[:1] == [("^", 0)] else parts
    parts = parts[:-1] if parts[-1:] == [("$", 0)] else parts
    return "^(?:" + "".join(piece for piece, _ in parts) + ")$"


def checkable(pattern: str) -> str:
    """`pattern` as Python's `re` reads it, for what matters here (which characters of ESCAPED
    it may match): properties as the characters of ESCAPED they hold, `(?<name>` as `(?P<name>`.
    Unchecked for syntax the two read differently."""
    out, previous = [], ""
    for piece, depth in pieces(pattern):
        if piece[:2] in ("\\p", "\\P"):
            members = "a" + "".join(f"\\x{ord(c):02x}" for c in property_members(piece))
            out.append(members if depth else f"[{members}]")
        elif depth > 1 and piece == "[":
            raise Unchecked("a '[' in a character class opens a nested class in outlines-core's regex "
                            "syntax, and is a character in JSON Schema's")
        elif depth and previous + piece in ("&&", "--", "~~"):
            raise Unchecked(f"{previous + piece!r} in a character class is a set operation in outlines-core's "
                            "regex syntax, two characters in JSON Schema's")
        else:
            out.append(piece)
        previous = piece if depth else ""
    return re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", "".join(out))


@functools.lru_cache(maxsize=256)
def property_members(prop: str) -> str:
    """The characters of ESCAPED that the property class `prop` (`\\p{L}`, `\\P{Cc}`, `\\pN`)
    holds, as outlines-core's regex engine reads it. Unchecked for a property it does not know."""
    import outlines_core
    tokens = {c.encode(): [i] for i, c in enumerate(ESCAPED)} | {b"a": [len(ESCAPED)]}
    try:
        index = outlines_core.Index(f"a|{prop}", outlines_core.Vocabulary(len(ESCAPED) + 1, tokens))
    except (ValueError, TypeError) as e:
        raise Unchecked(f"{prop!r} is not a property outlines-core's regex syntax knows ({e})") from None
    allowed = index.get_allowed_tokens(index.get_initial_state())
    return "".join(ESCAPED[i] for i in sorted(allowed) if i < len(ESCAPED))
