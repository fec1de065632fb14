"""examples/grpo.py is the README's loop in code: short, formatter-formatted, and every line of
the README's loop is a line of the script, in the script's order (abridged only by omission)."""

from __future__ import annotations

import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "grpo.py")
README = os.path.join(ROOT, "README.md")


def readme_loop() -> list[str]:
    text = open(README).read()
    head = text.index("`examples/grpo.py` is the whole GRPO loop")
    block = re.search(r"```python\n(.*?)```", text[head:], re.S)
    return [line for line in block.group(1).splitlines() if line.strip()]


def script_main() -> list[str]:
    """The body of `main`, dedented to the README's indentation."""
    lines = open(SCRIPT).read().splitlines()
    first = lines.index(next(line for line in lines if line.startswith("def main(")))
    body = []
    for line in lines[first + 1 :]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    return textwrap.dedent("\n".join(body)).splitlines()


def test_the_script_is_short_and_unskipped():
    src = open(SCRIPT).read()
    assert src.count("\n") <= 150
    assert "fmt: skip" not in src
    assert "10**" not in src  # no sentinel step counts


def test_the_readme_loop_is_the_script_abridged():
    script, at = script_main(), 0
    for line in readme_loop():
        assert line in script[at:], f"README's loop line not in examples/grpo.py's order: {line!r}"
        at = script.index(line, at) + 1
