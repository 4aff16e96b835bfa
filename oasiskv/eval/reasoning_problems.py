"""Checkable multi-step problems with short prompts and long worked answers: each asks the model
to write every step and end with `Answer: N`, so a free run goes on for hundreds to a couple of
thousand tokens after a prompt of about a hundred. The right answers are computed here, by
running the arithmetic or the program itself.

Three sets: `hard` (Collatz counts, modular recurrences, loop-heavy programs: many steps, beyond a
0.5B model), `easy` (word problems of two or three operations, programs of a few lines), where
a small model gets some right, so that dense and sparse task accuracy can differ, and `long`
(tables, running sums and countdowns written out line by line: 2K-4K generated tokens of simple
steps, the last of which is the answer)."""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

INSTRUCTION = "Work it out step by step, writing every step. End with a line `Answer: N`, N the number."


@dataclass(frozen=True)
class Problem:
    name: str
    question: str
    answer: int
    instruction: str = INSTRUCTION

    @property
    def prompt(self) -> str:
        return f"{self.question}\n{self.instruction}"


def collatz_steps(n: int) -> int:
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def collatz(n: int) -> Problem:
    return Problem(f"collatz-{n}", f"Start with n = {n}. Repeat: if n is even, n becomes n / 2; if n is odd, n "
                   f"becomes 3n + 1. Stop when n is 1. How many steps does it take to reach 1?", collatz_steps(n))


def recurrence(a0: int, mul: int, add: int, mod: int, times: int) -> Problem:
    a = a0
    for _ in range(times):
        a = (a * mul + add) % mod
    return Problem(f"recurrence-{a0}-{mul}-{add}-{mod}-{times}",
                   f"Let a = {a0}. Repeat {times} times: a becomes (a * {mul} + {add}) mod {mod}. "
                   f"What is a at the end?", a)


def program_output(name: str, source: str) -> Problem:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(source, {})  # our own programs, below: the right answer is what Python prints
    return Problem(name, f"What does this Python program print?\n```python\n{source}```", int(out.getvalue()))


PROGRAMS = {
    "loop-mod": "x = 7\nfor i in range(1, 21):\n    if x % 2 == 0:\n        x = x // 2 + i\n    else:\n"
                "        x = (3 * x + i) % 50\nprint(x)\n",
    "digit-sums": "total = 0\nfor n in range(10, 40):\n    total += sum(int(d) for d in str(n))\nprint(total)\n",
    "while-halving": "n, count = 1000, 0\nwhile n > 1:\n    n = n // 3 if n % 3 == 0 else n - 1\n"
                     "    count += 1\nprint(count)\n",
    "list-ops": "xs = [5, 3, 8, 1, 9, 2]\nfor i in range(len(xs)):\n    xs[i] = xs[i] * (i + 1) - xs[i - 1]\n"
                "print(sum(xs))\n",
    "nested-loops": "s = 0\nfor i in range(1, 6):\n    for j in range(i, 6):\n        s += i * j % 7\nprint(s)\n",
    "gcd-chain": "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n\ntotal = 0\n"
                 "for k in range(2, 14):\n    total += gcd(84, k * 6)\nprint(total)\n",
    "fib-mod": "a, b = 1, 1\nfor _ in range(25):\n    a, b = b, (a + b) % 100\nprint(b)\n",
}

_KINDS = (
    [collatz(n) for n in (6, 7, 9, 15, 25, 27, 31)],
    [recurrence(3, 5, 2, 17, 12), recurrence(4, 3, 7, 23, 15), recurrence(10, 7, 1, 31, 20),
     recurrence(2, 2, 3, 19, 25), recurrence(5, 4, 9, 29, 18), recurrence(1, 6, 5, 37, 30)],
    [program_output(name, source) for name, source in PROGRAMS.items()])
# The kinds interleaved, so that the first N (--problems N) mix them.
PROBLEMS: list[Problem] = [p for i in range(max(map(len, _KINDS))) for kind in _KINDS for p in kind[i:i + 1]]


SHORT_PROGRAMS = {
    "mul-sub": "x = 4\nx = x * 3\nx = x - 5\nprint(x)\n",
    "sum-range": "total = 0\nfor i in range(5):\n    total += i\nprint(total)\n",
    "max-min": "xs = [3, 1, 4, 1, 5]\nprint(max(xs) + min(xs))\n",
    "len-twice": "s = 'hello'\nprint(len(s) * 2)\n",
    "doubling": "n = 1\nfor _ in range(4):\n    n = n * 2\nprint(n)\n",
    "if-else": "a = 7\nif a > 5:\n    a = a - 2\nelse:\n    a = a + 2\nprint(a * 3)\n",
}
_EASY_KINDS = (
    [Problem("marbles", "Tom has 12 marbles. He gives 5 to Ann, then finds 9 more. How many marbles "
             "does Tom have now?", 12 - 5 + 9),
     Problem("eggs", "A box holds 6 rows of 7 eggs. 5 eggs break. How many eggs are left?", 6 * 7 - 5),
     Problem("train", "A train goes 60 km each hour for 3 hours, then 40 km in the next hour. How many "
             "km does it go in all?", 60 * 3 + 40),
     Problem("pages", "Sara reads 8 pages a day for 7 days, then 10 pages on the eighth day. How many "
             "pages does she read in all?", 8 * 7 + 10),
     Problem("candies", "There are 4 bags with 9 candies each. 11 candies are eaten. How many candies "
             "are left?", 4 * 9 - 11),
     Problem("perimeter", "A rectangle is 8 cm long and 5 cm wide. What is its perimeter in cm?",
             2 * (8 + 5))],
    [program_output(name, source) for name, source in SHORT_PROGRAMS.items()])
EASY_PROBLEMS: list[Problem] = [p for i in range(6) for kind in _EASY_KINDS for p in kind[i:i + 1]]


# No `Answer:` line asked for: small models write it first. The answer is the text's last number.
LONG_INSTRUCTION = "Write all the lines, one after another, and nothing else."


def times_table(k: int, n: int) -> Problem:
    return Problem(f"table-{k}x{n}", f"Write the {k} times table from {k} x 1 to {k} x {n}, one line each, "
                   f"as `{k} x i = result`.", k * n, LONG_INSTRUCTION)


def running_sum(n: int) -> Problem:
    return Problem(f"running-sum-{n}", f"Add the numbers from 1 to {n} one at a time: after adding each number "
                   f"i, write a line `+ i = total so far`.", n * (n + 1) // 2, LONG_INSTRUCTION)


def countdown(start: int, step: int) -> Problem:
    last = start - step * ((start - 1) // step)
    return Problem(f"countdown-{start}-by-{step}", f"Count down from {start} by {step} at a time, one number a "
                   f"line, while the number stays positive.", last, LONG_INSTRUCTION)


def squares(n: int) -> Problem:
    return Problem(f"squares-{n}", f"Write the square of every number from 1 to {n}, one line each, as "
                   f"`i^2 = square`.", n * n, LONG_INSTRUCTION)


# Long worked answers (2K-4K tokens of Qwen2.5's tokenizer, which writes a digit a token) made of
# steps a small model gets right, each read off the line before: the answer is right only if the
# run keeps its own format and arithmetic over the whole generation, sparse past its threshold.
LONG_PROBLEMS: list[Problem] = [times_table(7, 250), running_sum(150), countdown(3000, 5), squares(160),
                                times_table(13, 200), countdown(2000, 7)]
SETS = {"hard": PROBLEMS, "easy": EASY_PROBLEMS, "long": LONG_PROBLEMS}
