"""OpenAI's chat completions, as TGI serves them."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from .. import chat, inference
from ..deps import RegistryDep, SettingsDep
from ..errors import responses
from ..openapi import sse_content
from ..schemas.chat import ChatCompletion, ChatCompletionChunk, ChatRequest

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions", summary="Chat with the model's embedded chat template (OpenAI style)",
             response_model=ChatCompletion,
             responses={200: {"content": sse_content(ChatCompletionChunk), "description": "JSON, or SSE "
                              "chunks ending in [DONE] when stream=true"}, **responses(404, 422, 424, 429, 503)})
async def chat_completions(req: ChatRequest, registry: RegistryDep, settings: SettingsDep):
    started = await chat.start(req, registry, settings, stream=req.stream)
    if not req.stream:
        return chat.completion(started, await inference.finish(started))
    first = await inference.first_event(started)
    return StreamingResponse(chat.chunks(started, first), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
