"""What the service tests share besides fixtures: the demo's name and prompt, request bodies, and
`Server` (a client of an app whose lifespan runs, plus its registry and /metrics samples)."""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI

from service.demo import DEMO_NAME
from service.errors import ModelNotFound
from service.registry import ModelRegistry, ModelState

DEMO = DEMO_NAME
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def generate_body(max_new_tokens: int = 12, **parameters) -> dict:
    return {"inputs": CHAT_PROMPT, "parameters": {"max_new_tokens": max_new_tokens, **parameters}}


@dataclass
class Server:
    client: httpx.AsyncClient
    app: FastAPI

    @property
    def registry(self) -> ModelRegistry:
        return self.app.state.registry

    async def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (0 when absent)."""
        text = (await self.client.get("/metrics")).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            m = re.fullmatch(rf"{re.escape(name)}(?:\{{(.*)\}})? (\S+)", line)
            if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
                return float(m.group(2))
        return 0.0

    async def wait_state(self, name: str, state: ModelState, timeout: float = 60) -> None:
        with anyio.fail_after(timeout):
            while True:
                with contextlib.suppress(ModelNotFound):
                    if self.registry.get(name).state is state:
                        return
                await anyio.sleep(0.02)
