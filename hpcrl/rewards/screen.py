"""A cheap screen in front of SymPy: answers that would make it spin are scored before it sees them.

math-verify hands the parsed answer to SymPy, which evaluates numbers exactly: ``9^{9^{9}}`` asks for a
number of 370 million digits and never returns, ``1000000!`` takes seconds, an answer 12 braces deep
as long. Each one costs the pool a full per-sample time limit and a process restart. The
screen reads the answer region with plain string code (microseconds) and says ``wrong`` when it is
far out of reach of the reference: more digits than any reference answer has, nested deeper or
much longer than it, an unevaluated sum, product, integral or limit where the reference is in closed
form (SymPy evaluates ``\\sum_{k=1}^{100000} 1/k`` term by term and ``\\int x^{50} e^x \\sin x`` for
longer than any time limit), a bracketed expression raised beyond ``MAX_SYMBOLIC_EXPONENT``. A reference that itself fails the screen turns the screen off for that sample (SymPy and the
time limit decide), so a data set with astronomically large answers is scored as before.
"""

from __future__ import annotations

import math
import re

MAX_DIGITS = 10_000
"""A power or factorial whose exact value has more digits than this is out of reach. SymPy builds
10^{1000000} in ~0.4 s and 1000000! in ~7 s, never 10^{100000000}; 10,000 digits take milliseconds, and no reference
answer of a math data set comes near (2^{100} has 31)."""
MAX_NESTING = 8
"""Brackets nested deeper than this: math-verify's parser slows down with depth, steeply past 10
(measured on a loaded 2-core machine: 12 nested braces 6 s, 20 nested \\frac 150 s), while written
answers rarely go past 4."""
MAX_ANSWER_CHARS = 400
"""An answer longer than this (and than four times the reference) is not checked symbolically: an
80-term polynomial (0.7 KB) took 2.6 s to compare with a number, a 200-term one 3.3 s."""

MAX_SYMBOLIC_EXPONENT = 100
"""A bracketed expression SymPy cannot size as a number, raised to more than this: ``(1+\\sqrt{2})^{1000}``
took 1.2 s to compare with a number, ``^{100000}`` past any time limit (a single letter raised to any
power stays symbolic and cheap: ``x^{100000} - 1`` 0.2 s)."""

_BOXED = "\\boxed{"
_BIG_OPERATOR = re.compile(r"\\(?:sum|prod|coprod|i{1,3}nt|oint|lim(?:sup|inf)?)(?![A-Za-z])")
"""Commands whose operand SymPy evaluates: a sum term by term, an integral by the Risch algorithm."""
_TAIL_MATH = re.compile(r"(?:\$\$?|\\\[|\\\()([^$]*?)(?:\$\$?|\\\]|\\\))[\s.,;:!]*$")
"""A math segment ($...$, $$...$$, \\[...\\], \\(...\\)) that ends the text: what math-verify reads as
the answer of an unboxed completion."""


def answer_region(text: str) -> tuple[str, bool]:
    """What math-verify reads first: the last ``\\boxed{...}``'s content, and True; else (no box, or
    one never closed, which math-verify still reads in part) the whole text and False."""
    start = text.rfind(_BOXED)
    if start >= 0:
        body = text[start + len(_BOXED) :]
        end = _group_end(body, 0, "{", "}", depth=1, limit=len(body))
        if end is not None:
            return body[:end], True
    return text, False


def out_of_reach(completion: str, answer: str) -> str | None:
    """Why the completion's answer cannot be checked cheaply against ``answer`` (None: it can).

    The screen applies only when the reference passes it itself. An answer region that is not a
    closed box (prose, a truncated box) is only searched for huge numbers, its length and brackets
    being prose's, unless it ends in a math segment: that segment is screened as a box is (working
    earlier in the text may hold a \\sum that is no answer)."""
    if _problem(answer, len(answer), answer) is not None:
        return None
    region, boxed = answer_region(completion)
    max_chars = max(MAX_ANSWER_CHARS, 4 * len(answer))
    if boxed:
        return _problem(region, max_chars, answer)
    tail = _TAIL_MATH.search(region[-4 * max_chars :])
    return _problem(tail.group(1), max_chars, answer) if tail else huge_number(region)


def _problem(region: str, max_chars: int, answer: str) -> str | None:
    if len(region) > max_chars:
        return f"answer longer than {max_chars} characters"
    if nesting(region) > MAX_NESTING:
        return f"brackets nested deeper than {MAX_NESTING}"
    if (found := _BIG_OPERATOR.search(region)) and not _BIG_OPERATOR.search(answer):
        return f"an unevaluated {found.group()} (the reference is in closed form)"
    return huge_number(region)


def nesting(text: str) -> int:
    """Deepest bracket nesting ({}, (), []); stray closers do not go below zero."""
    depth = deepest = 0
    for ch in text:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]":
            depth = max(0, depth - 1)
    return deepest


_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_LATEX_TIMES = re.compile(r"\\(?:cdot|times)")
_OPERAND_CHARS = 64
"""An operand (base, exponent, factorial argument) longer than this is not read: it keeps the screen's
cost linear in the text's length."""


def huge_number(text: str) -> str | None:
    """A power or factorial of known numbers with more than MAX_DIGITS digits, or a bracketed
    expression raised past MAX_SYMBOLIC_EXPONENT, anywhere in ``text``."""
    text = _LATEX_TIMES.sub("*", text.replace("\\left", "").replace("\\right", ""))
    for i, ch in enumerate(text):
        if ch == "^" and (why := _power_problem(text, i)):
            return why
        elif ch == "!" and not text.startswith("!=", i):
            n = _value(_operand_before(text, i))
            if n is not None and _factorial_log10(n) > MAX_DIGITS:
                return f"a factorial with more than {MAX_DIGITS} digits"
    return None


def _power_problem(text: str, i: int) -> str | None:
    """Why the power whose ``^`` is at ``i`` is out of reach (None: it is not)."""
    operand, exponent = _operand_before(text, i), _exponent_after(text, i + 1)
    base = _value(operand)
    if exponent is None:
        return None
    if base and _log10(base) * abs(exponent) > MAX_DIGITS:
        return f"a power with more than {MAX_DIGITS} digits"
    # a bracketed expression, not a single letter (x^{1000} stays symbolic)
    if base is None and abs(exponent) > MAX_SYMBOLIC_EXPONENT and operand[:1] in ("(", "{", "["):
        return f"an expression raised to more than {MAX_SYMBOLIC_EXPONENT}"
    return None


def _log10(x: float) -> float:
    """|log10 x|: digits of a power of x per unit of exponent (NaN: not a number SymPy would build)."""
    if math.isnan(x):
        return 0.0
    return abs(math.log10(abs(x))) if math.isfinite(x) else math.inf


def _factorial_log10(n: float) -> float:
    if not n >= 2:  # also NaN
        return 0.0
    return math.lgamma(n + 1) / math.log(10) if math.isfinite(n) else math.inf


def _group_end(text: str, start: int, opens: str, closes: str, depth: int, limit: int) -> int | None:
    """Index of the closer that brings ``depth`` to 0, scanning from ``start`` (None: not within limit)."""
    for k in range(start, min(len(text), start + limit)):
        if text[k] in opens:
            depth += 1
        elif text[k] in closes:
            depth -= 1
            if depth == 0:
                return k
    return None


def _operand_before(text: str, end: int) -> str:
    """The number or bracketed group that ends at ``end`` (empty when it is neither)."""
    j = end
    while j > 0 and text[j - 1] == " ":
        j -= 1
    if j > 0 and text[j - 1] in "})]":
        mirrored = text[max(0, j - _OPERAND_CHARS) : j][::-1]
        k = _group_end(mirrored, 0, "})]", "{([", depth=0, limit=len(mirrored))
        return "" if k is None else text[j - k - 1 : j]
    k = j
    while k > 0 and j - k < _OPERAND_CHARS and (text[k - 1].isdigit() or text[k - 1] == "."):
        k -= 1
    return text[k:j] if k == 0 or not text[k - 1].isalpha() else ""  # "x2^9": not a number


def _exponent_after(text: str, start: int) -> float | None:
    """The value of the exponent that starts at ``start``: a braced group or a number, and what is
    raised onto it in turn (9^9^9 is 9^(9^9); LaTeX reads 9^99 as 9^9 9, math-verify as 9^{99}: the
    larger is taken). None when any part of it is not a known number."""
    parts: list[float | None] = []
    j = start
    while len(parts) < 16:
        j = _skip_spaces(text, j)
        if text.startswith("{", j):
            end = _group_end(text, j, "{", "}", depth=0, limit=_OPERAND_CHARS)
            if end is None:
                return None
            parts.append(_value(text[j : end + 1]))
            j = end + 1
        elif match := _NUMBER.match(text, j):
            parts.append(float(match.group()) if match.end() - j < _OPERAND_CHARS else None)
            j = match.end()
        else:
            return None
        j = _skip_spaces(text, j)
        if not text.startswith("^", j):
            break
        j += 1
    if not parts or None in parts:
        return None
    value = parts[-1]
    for base in reversed(parts[:-1]):
        value = _power(base, value)  # type: ignore[arg-type]
    return value


def _skip_spaces(text: str, j: int) -> int:
    while j < len(text) and text[j] == " ":
        j += 1
    return j


def _power(base: float, exponent: float) -> float:
    """base**exponent in floats, inf where it overflows (or would take long to find out)."""
    if exponent > 1e6 and abs(base) > 1:
        return math.inf
    try:
        result = base**exponent
    except OverflowError:
        return math.inf
    return math.nan if isinstance(result, complex) else result  # (-8)^{1/3}


_ARITHMETIC = re.compile(r"[\d.\s+\-*/^(){}\[\]!]+")


def _value(expr: str) -> float | None:
    """The value of a bracketed integer expression (+ - * / ^ !), inf when it overflows; None when it
    holds anything else (a variable, a command) or does not read."""
    expr = expr.strip()
    if not expr or not _ARITHMETIC.fullmatch(expr):
        return None
    try:
        return _Reader(expr).read()
    except (ValueError, TypeError, IndexError, RecursionError, ZeroDivisionError, OverflowError):
        return None


class _Reader:
    """Recursive descent over + - * / ^ ! and brackets, in floats that saturate at inf."""

    def __init__(self, expr: str) -> None:
        self.s = expr.replace(" ", "")
        self.i = 0

    def read(self) -> float:
        value = self.sum()
        if self.i != len(self.s):
            raise ValueError(self.s)
        return value

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def sum(self) -> float:
        value = self.product()
        while self.peek() in ("+", "-"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def product(self) -> float:
        value = self.power()
        while self.peek() in ("*", "/"):
            op = self.s[self.i]
            self.i += 1
            rhs = self.power()
            value = value * rhs if op == "*" else value / rhs
        return value

    def power(self) -> float:
        base = self.factorial()
        if self.peek() != "^":
            return base
        self.i += 1
        return _power(base, self.power())  # right-associative: 9^9^9 is 9^(9^9)

    def factorial(self) -> float:
        value = self.atom()
        while self.peek() == "!":
            self.i += 1
            value = math.inf if value > 170 else float(math.factorial(int(value)))
        return value

    def atom(self) -> float:
        ch = self.peek()
        if ch in ("(", "{", "["):
            self.i += 1
            value = self.sum()
            if self.peek() not in (")", "}", "]"):
                raise ValueError(self.s)
            self.i += 1
            return value
        if ch == "-":
            self.i += 1
            return -self.atom()
        match = _NUMBER.match(self.s, self.i)
        if not match:
            raise ValueError(self.s)
        self.i = match.end()
        return float(match.group())
