"""Agents: what the daemon says back to what it heard.

An agent is made per session (so it can keep that caller's history) and answers one transcript
at a time with an async stream of text pieces, each a sentence or more, which the conversation
speaks as soon as it arrives.

Telephone callers also press keys: an agent with `on_dtmf(digit)` gets each DTMF digit and answers
it the same way (an IVR menu is an agent plug-in). Either method can end the call by yielding (or
raising) `EndCall`: what it said before is spoken, then the session hangs up.

An agent whose answer has no side effect may declare `speculative = True` and give `rollback()`,
which forgets the last reply it was asked for (its history, its state): the conversation then asks it
while the caller's turn is not yet confirmed and, if the caller goes on speaking, closes that reply's
stream and calls `rollback()` (voiced.core.conversation). An agent that books, buys or sends must not.

- `echo`: says back what it heard (needs nothing; the default).
- `openai`: any OpenAI-compatible `/v1/chat/completions` streaming endpoint (vLLM, llama.cpp,
  TensorRT-LLM's server, OpenAI itself), with per-session history and a system prompt.
- `client`: never answers by itself; the caller sends `Speak` controls (IVR).
- plug-ins: any installed package that declares an entry point in the group `voiced.agents`,
  pointing at a callable `factory(config: AgentConfig, system_prompt: str) -> Agent`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from importlib.metadata import entry_points
from typing import Protocol

import httpx

from voiced.config import AgentConfig
from voiced.text import SentenceBuffer

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "voiced.agents"


class AgentError(Exception):
    """The agent could not answer; the session reports it and goes on."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class EndCall(Exception):
    """Yielded (or raised) by an agent to end the call once what it has said is spoken."""

    def __init__(self, reason: str = ""):
        super().__init__(reason)
        self.reason = reason


class Agent(Protocol):
    def reply(self, text: str) -> AsyncIterator[str | EndCall]: ...

    # Optional: `speculative = True` with `def rollback(self) -> None` (module docstring).

    # Optional: `async def on_dtmf(self, digit: str) -> AsyncIterator[str | EndCall]`, a key the
    # caller pressed ("0"-"9", "*", "#", "A"-"D"). Agents without it never hear keys.


class EchoAgent:
    speculative = True  # it keeps nothing

    def rollback(self) -> None:
        pass

    async def reply(self, text: str) -> AsyncIterator[str]:
        yield text.strip()


class OpenAIAgent:
    """Streams a chat completion and yields it sentence by sentence as tokens arrive."""

    def __init__(self, config: AgentConfig, system_prompt: str, client: httpx.AsyncClient | None = None):
        self.config = config
        self.history: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._client = client
        self._before_last: list[dict[str, str]] | None = None  # the history before the last reply

    # A chat completion changes nothing but this history, so a reply can be asked early and forgotten.
    speculative = True

    def rollback(self) -> None:
        """Forget the last reply: the question and whatever part of the answer it kept."""
        if self._before_last is not None:
            self.history, self._before_last = self._before_last, None

    async def reply(self, text: str) -> AsyncIterator[str]:
        c = self.config
        self._before_last = list(self.history)
        self.history.append({"role": "user", "content": text})
        body = {"model": c.openai_model, "messages": self.history, "stream": True}
        headers = {"Authorization": f"Bearer {c.openai_api_key}"} if c.openai_api_key else {}
        url = c.openai_base_url.rstrip("/") + "/chat/completions"
        answer: list[str] = []
        sentences = SentenceBuffer()
        client = self._client or httpx.AsyncClient(timeout=httpx.Timeout(c.openai_timeout_s, connect=5.0))
        try:
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:300]
                    raise AgentError("AGENT_FAILED", f"the agent endpoint {url} answered HTTP {resp.status_code}: {detail}")
                async for piece in _sse_content(resp):
                    answer.append(piece)
                    for sentence in sentences.feed(piece):
                        yield sentence
            for sentence in sentences.flush():
                yield sentence
        except httpx.TimeoutException:
            raise AgentError("AGENT_TIMEOUT", f"the agent endpoint {url} did not answer within {c.openai_timeout_s} s") from None
        except httpx.HTTPError as e:
            raise AgentError("AGENT_UNAVAILABLE", f"cannot reach the agent endpoint {url}: {e}") from None
        finally:
            if self._client is None:
                await client.aclose()
            if answer:
                self.history.append({"role": "assistant", "content": "".join(answer)})
            else:
                self.history.pop()  # the question got no answer; don't leave it dangling
            # Keep the system prompt and the last turns only.
            keep = 2 * c.max_history_turns
            system = self.history[:1] if self.history and self.history[0]["role"] == "system" else []
            self.history = system + self.history[len(system):][-keep:]


async def _sse_content(resp: httpx.Response) -> AsyncIterator[str]:
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise AgentError("AGENT_FAILED", f"the agent endpoint sent a malformed event: {data[:100]!r}") from None
        for choice in chunk.get("choices") or ():
            content = (choice.get("delta") or {}).get("content")
            if content:
                yield content


class AgentRegistry:
    """Names -> agent factories; built-ins plus installed plug-ins."""

    def __init__(self, config: AgentConfig | None = None):
        self.config = config or AgentConfig()
        self._factories: dict[str, Callable[[AgentConfig, str], Agent | None]] = {
            "echo": lambda cfg, prompt: EchoAgent(),
            "openai": lambda cfg, prompt: OpenAIAgent(cfg, prompt),
            "client": lambda cfg, prompt: None,
        }
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._factories:
                log.warning("agent plug-in %s (%s) ignored: the name is taken", ep.name, ep.value)
                continue
            self._factories[ep.name] = _lazy(ep)

    def names(self) -> list[str]:
        return sorted(self._factories)

    def register(self, name: str, factory: Callable[[AgentConfig, str], Agent | None]) -> None:
        self._factories[name] = factory

    def create(self, name: str, system_prompt: str) -> Agent | None:
        """None for the client-driven agent (it never answers by itself)."""
        return self._factories[name](self.config, system_prompt)


def _lazy(ep):
    def factory(config: AgentConfig, prompt: str):
        return ep.load()(config, prompt)

    return factory
