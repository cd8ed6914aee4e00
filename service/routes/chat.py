"""OpenAI's chat completions."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .. import chat, inference
from ..deps import RegistryDep, SettingsDep
from ..errors import openai_responses
from ..openapi import sse_content, sse_response
from ..schemas.chat import ChatCompletion, ChatCompletionChunk, ChatRequest

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions", summary="Chat with the model's embedded chat template (OpenAI style)",
             response_model=ChatCompletion,
             responses={200: {"content": sse_content(ChatCompletionChunk), "description": "JSON, or SSE "
                              "chunks ending in [DONE] when stream=true"}, **openai_responses(400, 404, 413, 429, 500, 503)})
async def chat_completions(req: ChatRequest, registry: RegistryDep, settings: SettingsDep, request: Request):
    started = await chat.start(req, registry, settings)
    if not req.stream:
        return chat.completion(started, await inference.finish_all(started, request), req)
    firsts = await inference.first_events(started)
    return sse_response(chat.chunks(started, firsts, req))
