"""A two-turn chat harness run in-process: no program to install, so no `uv` and no network needed."""

from openai import AsyncOpenAI

import verifiers.v1 as vf

FOLLOW_UP = "Say it again."


class EchoHarnessConfig(vf.HarnessConfig):
    turns: int = 2
    """Model calls per rollout; each later turn appends FOLLOW_UP as a user message."""


class EchoHarness(vf.Harness[EchoHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_text_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            for turn in range(self.config.turns):
                if turn:
                    messages.append({"role": "user", "content": FOLLOW_UP})
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
