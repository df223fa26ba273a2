"""MATH-style scoring: take the last ``\\boxed{...}`` of a response and test it for equivalence.

The reference answers of MATH-like datasets are LaTeX written by people, so string equality is
too strict: ``\\dfrac{1}{2}``, ``\\frac12``, ``0.5`` and ``1/2`` are one answer, as are
``\\left( 1, 2 \\right)`` and ``(1,2)``, ``90^\\circ`` and ``90``, ``10\\%`` and ``10``, and
``1,000`` and ``1000``. ``normalize_math_answer`` removes that notation (after the
normalisation of Hendrycks et al.'s MATH paper, extended with fractions-vs-decimals); ``is_equiv``
compares normalised strings, then exact rational values, then tuples/intervals element-wise.
No computer algebra: ``x+1`` and ``1+x`` are different answers.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _matching_brace(text: str, open_pos: int) -> int | None:
    """Index of the ``}`` that closes the ``{`` at ``open_pos``; None if unbalanced."""
    depth = 0
    for i in range(open_pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Nested braces are matched: ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``. None when there is
    no box or its braces are unbalanced.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = start + len(cmd)
    if text.startswith(" ", rest):  # "\boxed 5": the argument runs to the next "$" or space
        match = re.match(r" +([^\s$]+)", text[rest:])
        return match.group(1) if match else None
    if not text.startswith("{", rest):
        return None
    end = _matching_brace(text, rest)
    return None if end is None else text[rest + 1 : end]


def _replace_command_arg(text: str, command: str, fn) -> str:
    """Replace every ``\\command{arg}`` by ``fn(arg)`` (balanced braces), innermost last."""
    out = []
    i = 0
    while True:
        j = text.find(command + "{", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        open_pos = j + len(command)
        end = _matching_brace(text, open_pos)
        if end is None:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        out.append(fn(text[open_pos + 1 : end]))
        i = end + 1


def _fix_shorthand_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{x}`` -> ``\\frac{1}{x}``, ``\\frac{a}2`` ->
    ``\\frac{a}{2}``."""
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\frac(\{[^{}]*\})(\w)", r"\\frac\1{\2}", text)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)


def _fracs_to_slash(text: str) -> str:
    """``\\frac{a}{b}`` -> ``a/b`` (``(a+1)/b`` for compound terms), nested fractions too."""
    while True:
        j = text.find("\\frac{")
        if j < 0:
            return text
        num_open = j + len("\\frac")
        num_end = _matching_brace(text, num_open)
        if num_end is None or not text.startswith("{", num_end + 1):
            return text
        den_end = _matching_brace(text, num_end + 1)
        if den_end is None:
            return text
        num = _wrap(text[num_open + 1 : num_end])
        den = _wrap(text[num_end + 2 : den_end])
        text = f"{text[:j]}{num}/{den}{text[den_end + 1 :]}"


def _wrap(term: str) -> str:
    """Parenthesise a fraction's numerator or denominator unless it is a single token."""
    return term if re.fullmatch(r"-?[\w.]+", term) else f"({term})"


_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a LaTeX answer (see the module docstring for what is removed)."""
    s = str(answer).strip()
    boxed = extract_boxed_answer(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\n", "").replace("\\displaystyle", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\:", "")
    s = s.replace("\\qquad", "").replace("\\quad", "").replace("\\ ", " ")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\{", "{").replace("\\}", "}")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\circ", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    # "5 \text{ cm}": a \text that starts with a space is a unit on the right; drop it.
    if "\\text{ " in s:
        s = s.split("\\text{ ")[0]
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox", "\\mathbf"):
        s = _replace_command_arg(s, cmd, lambda arg: arg)
    s = s.strip()
    # "x = 5" -> "5" when the left side is a short variable name.
    if s.count("=") == 1:
        left, right = s.split("=")
        if len(left.strip()) <= 2 and re.fullmatch(r"[A-Za-z]*", left.strip()):
            s = right
    s = s.replace(" ", "")
    s = _fix_shorthand_fracs(s)
    s = _fracs_to_slash(s)
    s = s.rstrip(".")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)  # ".5" -> "0.5"
    return s


_RATIONAL = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:/([+-]?(?:\d+(?:\.\d*)?|\.\d+)))?")


def to_rational(text: str) -> Fraction | None:
    """The exact value of a normalised number: ``"3"``, ``"-0.25"``, ``"1/2"``, ``"-3/4"``; else None."""
    match = _RATIONAL.fullmatch(text)
    if match is None:
        return None
    value = Fraction(match.group(1))
    if match.group(2) is not None:
        den = Fraction(match.group(2))
        if den == 0:
            return None
        value /= den
    return value


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _equiv_normalized(a: str, b: str) -> bool:
    if a == b:
        return True
    ra, rb = to_rational(a), to_rational(b)
    if ra is not None and rb is not None:
        return ra == rb
    # Tuples and intervals: same brackets, same length, equal elements.
    if len(a) >= 2 and len(b) >= 2 and a[0] == b[0] and a[-1] == b[-1] and a[0] in "([{" and a[-1] in ")]}":
        xs, ys = _split_top_level(a[1:-1]), _split_top_level(b[1:-1])
        return len(xs) == len(ys) > 1 and all(_equiv_normalized(x, y) for x, y in zip(xs, ys))
    if "," in a and "," in b:  # bare lists "1,2" (not thousands: those were normalised)
        xs, ys = _split_top_level(a), _split_top_level(b)
        return len(xs) == len(ys) > 1 and all(_equiv_normalized(x, y) for x, y in zip(xs, ys))
    return False


def is_equiv(answer: str, reference: str) -> bool:
    """Whether two LaTeX answers are the same after normalisation (string or exact rational)."""
    return _equiv_normalized(normalize_math_answer(answer), normalize_math_answer(reference))


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last ``\\boxed{}`` of the response is equivalent to the reference, else 0.0.

    The reference may be bare (``"\\frac{1}{2}"``) or a full solution with its own box.
    """
    answer = extract_boxed_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if is_equiv(answer, str(ground_truth)) else 0.0
