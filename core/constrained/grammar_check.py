"""Checking a grammar before any decoding: one xgrammar cannot read, or one no output can ever
complete, is the caller's error (a 400), not a request the scheduler starts and then aborts.

xgrammar accepts schemas like `{"$ref": "#"}` or a `$ref` cycle (`a -> b -> a`) and compiles
them to rules such as `root ::= root`: a grammar with no finite string. Its matcher then allows no
token at all (or only ones leading into the loop), so the request samples from a fully masked
row, writes junk and ends with finish_reason "abort". `check_grammar` finds such grammars by the
classic productivity fixpoint over xgrammar's own rules (printed as EBNF): a rule is productive
when one of its alternatives is a sequence of productive parts, and the grammar is possible only
when its root rule is. A part this reader does not know (a construct of a newer xgrammar) counts
as productive, so the check can miss an impossible grammar but never refuses a possible one.
"""

from __future__ import annotations

import functools
import re
from typing import Any

ANY_JSON = "$$ANY$$"  # json_schema value meaning "any JSON object" (OpenAI's json_object)

# Tokens of xgrammar's printed EBNF: strings and character classes (with escapes), quantifiers,
# lookahead openers, names, and single-character punctuation.
_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<rep>\{\s*-?\d+\s*(?:,\s*-?\d+\s*)?\})'
    r"|(?P<look>\(=)|(?P<name>[A-Za-z_][A-Za-z0-9_.]*)|(?P<op>[()|*+?,=]))",
    re.S,
)


class _Unreadable(Exception):
    """The printed grammar has a shape this reader does not know: no verdict."""


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        if body[pos:].strip() == "":
            break
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _Unreadable(body[pos : pos + 20])
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Rules:
    """Parses one rule body into nested ("alt", [seq, ...]) / ("seq", [part, ...]) trees whose
    leaves are ("term",) and ("ref", name); a part repeated possibly zero times is ("term",)."""

    def __init__(self, toks: list[tuple[str, str]]):
        self.toks, self.i = toks, 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise _Unreadable("unexpected end")
        self.i += 1
        return tok

    def skip_group(self) -> None:
        """Past the ")" matching an opener already taken (lookaheads, function-like terms)."""
        depth = 1
        while depth:
            kind, text = self.take()
            if kind == "look" or (kind == "op" and text == "("):
                depth += 1
            elif kind == "op" and text == ")":
                depth -= 1

    def alt(self, closing: str | None) -> tuple:
        seqs = [self.seq()]
        while (tok := self.peek()) is not None and tok == ("op", "|"):
            self.take()
            seqs.append(self.seq())
        if closing is not None and self.take() != ("op", closing):
            raise _Unreadable("unbalanced")
        return ("alt", seqs)

    def seq(self) -> tuple:
        parts = []
        while (tok := self.peek()) is not None and tok not in (("op", "|"), ("op", ")")):
            kind, text = self.take()
            if kind == "look":  # (=(...)): a lookahead constrains what follows, it adds nothing
                self.skip_group()
                continue
            if kind in ("str", "cls"):
                part: tuple = ("term",)
            elif kind == "name":
                if self.peek() == ("op", "("):  # Regex("...", ...), TagDispatch(...): a terminal
                    self.take()
                    self.skip_group()
                    part = ("term",)
                else:
                    part = ("ref", text)
            elif (kind, text) == ("op", "("):
                part = self.alt(")")
            else:
                raise _Unreadable(text)
            parts.append(self.quantified(part))
        return ("seq", parts)

    def quantified(self, part: tuple) -> tuple:
        tok = self.peek()
        if tok is None:
            return part
        kind, text = tok
        if kind == "op" and text in "*?":
            self.take()
            return ("term",)  # zero repetitions are allowed
        if kind == "op" and text == "+":
            self.take()
            return part
        if kind == "rep":
            self.take()
            least = int(text.strip("{} ").split(",")[0])
            return ("term",) if least <= 0 else part
        return part


def _productive(tree: tuple, known: set[str], defined: set[str]) -> bool:
    kind = tree[0]
    if kind == "term":
        return True
    if kind == "ref":
        return tree[1] in known or tree[1] not in defined  # a rule we did not see: assume fine
    if kind == "alt":
        return any(_productive(s, known, defined) for s in tree[1])
    return all(_productive(p, known, defined) for p in tree[1])


def unproductive_rules(ebnf: str, root: str = "root") -> set[str] | None:
    """The rules of a printed grammar that derive no finite string, or None when the text has a
    shape this reader does not know or no `root` rule. Empty when the root is productive."""
    bodies: dict[str, tuple] = {}
    try:
        for line in ebnf.splitlines():
            if not line.strip():
                continue
            name, sep, body = line.partition("::=")
            if not sep:
                raise _Unreadable(line[:20])
            parser = _Rules(_tokens(body))
            bodies[name.strip()] = parser.alt(None)
            if parser.peek() is not None:
                raise _Unreadable("trailing text")
    except _Unreadable:
        return None
    if root not in bodies:
        return None
    defined, known = set(bodies), set()
    changed = True
    while changed:
        changed = False
        for name, tree in bodies.items():
            if name not in known and _productive(tree, known, defined):
                known.add(name)
                changed = True
    return set() if root in known else defined - known


def _first_line(e: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] /path/file.cc:83: " prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)


def build_grammar(kind: str, text: str) -> Any:
    """The xgrammar Grammar for (kind, text), checked: ValueError naming the kind for one xgrammar
    cannot read or one that no output can complete. ImportError without xgrammar."""
    import xgrammar

    try:
        if kind == "json_schema":
            if text == ANY_JSON:
                return xgrammar.Grammar.builtin_json_grammar()
            grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
        elif kind == "regex":
            grammar = xgrammar.Grammar.from_regex(text)
        elif kind == "ebnf":
            grammar = xgrammar.Grammar.from_ebnf(text)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}; one of json_schema, regex, ebnf")
    except ValueError as e:
        if str(e).startswith("unknown grammar kind"):
            raise
        raise ValueError(f"invalid {kind}: {_first_line(e)}") from None
    except Exception as e:  # xgrammar raises RuntimeError and its own types
        if kind == "json_schema" and "Circular $ref" in str(e):
            # xgrammar >= 0.2.9 refuses a bare $ref loop itself; say it as the rule check below does
            raise ValueError(f"invalid {kind}: {_NO_FINITE_VALUE} ({_first_line(e)})") from None
        raise ValueError(f"invalid {kind}: {_first_line(e)}") from None
    dead = unproductive_rules(str(grammar))
    if dead:
        what = (
            _NO_FINITE_VALUE
            if kind == "json_schema"
            else "no output can ever complete it: its rules only loop back into each other"
        )
        raise ValueError(f"invalid {kind}: {what} (rules without an end: {', '.join(sorted(dead)[:5])})")
    return grammar


_NO_FINITE_VALUE = (
    "the schema admits no finite value: every way through it loops back through a $ref "
    '(as {"$ref": "#"} or a cycle of $defs does); give the recursion a way out, such as an '
    "optional property or an anyOf branch without the $ref"
)


def check_grammar(kind: str, text: str) -> None:
    """Raise ValueError (a 400 for the caller) when (kind, text) is no usable grammar; a no-op
    without xgrammar (the engine then says structured outputs need it). Grammars found usable are
    remembered, so a repeated one costs a lookup."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return
    _checked(kind, text)


@functools.lru_cache(maxsize=256)
def _checked(kind: str, text: str) -> bool:
    build_grammar(kind, text)  # raises for a bad one (exceptions are not cached: checked again)
    return True
