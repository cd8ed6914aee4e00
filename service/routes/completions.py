"""OpenAI's (legacy) completions: raw prompts in, text out."""
from __future__ import annotations

from fastapi import APIRouter, Request

from .. import completions, inference
from ..deps import RegistryDep, SettingsDep
from ..errors import openai_responses
from ..openapi import sse_content, sse_response
from ..schemas.completions import Completion, CompletionRequest

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/completions", summary="Complete a raw prompt, or several batched together (OpenAI style)",
             response_model=Completion,
             responses={200: {"content": sse_content(Completion), "description": "JSON, or SSE chunks ending "
                              "in [DONE] when stream=true"}, **openai_responses(400, 404, 413, 429, 500, 503)})
async def create_completion(req: CompletionRequest, registry: RegistryDep, settings: SettingsDep, request: Request):
    started = await completions.start(req, registry, settings)
    if not req.stream:
        return completions.completion(started, await inference.finish_all(started, request), req)
    firsts = await inference.first_events(started)
    return sse_response(completions.chunks(started, firsts, req))
