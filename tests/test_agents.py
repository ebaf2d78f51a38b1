"""Agents: sentence splitting as text streams in, and plug-ins found through entry points."""

from __future__ import annotations

import asyncio
import sys
import textwrap

from voiced.core.agents import AgentRegistry
from voiced.text import SentenceBuffer, split_sentences


def test_sentences_leave_as_soon_as_they_are_complete():
    buf = SentenceBuffer()
    pieces = ["Sure", ". The shop opens at ni", "ne. Bring your", " receipt!", " Bye"]
    out = [buf.feed(p) for p in pieces]
    # A sentence is complete once the space after its full stop arrives (it could still be "!!" before).
    assert out == [[], [], ["Sure. The shop opens at nine."], [], ["Bring your receipt!"]]
    assert buf.flush() == ["Bye"]
    assert split_sentences("One two three four. Five six seven eight?\nNine") == [
        "One two three four.", "Five six seven eight?", "Nine"]


def test_a_plugin_agent_is_found_through_its_entry_point(tmp_path, monkeypatch):
    pkg = tmp_path / "shop_agent.py"
    pkg.write_text(textwrap.dedent('''
        class ShopAgent:
            def __init__(self, config, prompt):
                self.prompt = prompt
            async def reply(self, text):
                yield f"You said {text}. We open at nine."

        def factory(config, prompt):
            return ShopAgent(config, prompt)
    '''))
    dist = tmp_path / "shop_agent-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shop-agent\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[voiced.agents]\nshop = shop_agent:factory\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = AgentRegistry()
    assert "shop" in registry.names()
    agent = registry.create("shop", "Be brief.")

    async def collect():
        return [piece async for piece in agent.reply("hello")]

    assert asyncio.run(collect()) == ["You said hello. We open at nine."]
    assert agent.prompt == "Be brief."
    sys.modules.pop("shop_agent", None)
