"""The README shows only integration snippets that tests execute: the Lightning and Accelerate
snippets below are the exact strings ``test_lightning`` and ``test_accelerate`` run."""

from __future__ import annotations

from pathlib import Path

import test_accelerate
import test_lightning

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _code_blocks(text: str) -> list[str]:
    blocks, inside, cur = [], False, []
    for line in text.splitlines():
        if line.startswith("```"):
            if inside:
                blocks.append("\n".join(cur) + "\n")
            inside, cur = not inside, []
        elif inside:
            cur.append(line)
    return blocks


def test_lightning_snippet_is_the_tested_one():
    assert test_lightning.README_SNIPPET in _code_blocks(README)


def test_accelerate_snippets_are_the_tested_ones():
    blocks = _code_blocks(README)
    assert test_accelerate.README_SNIPPET in blocks
    resume = [b for b in blocks if "load_state" in b]
    assert len(resume) == 1
    assert test_accelerate.RESUME_SNIPPET.endswith(resume[0])


def test_no_comm_hook_slot_promised():
    """The old README offered Lightning's ddp_comm_hook and an Accelerate comm-hook slot; both
    silently did nothing."""
    assert "ddp_comm_hook" not in README and "comm-hook slot" not in README
