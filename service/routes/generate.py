"""TGI's generation routes: /generate, /generate_stream, the compatibility route /, /tokenize and
/chat_tokenize."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from .. import chat, inference, tgi
from ..deps import RegistryDep, SettingsDep
from ..errors import responses
from ..openapi import sse_content, sse_response
from ..schemas.chat import ChatRequest
from ..schemas.tgi import (
    ChatTokenizeResponse,
    CompatGenerateRequest,
    GenerateRequest,
    GenerateResponse,
    SimpleToken,
    StreamResponse,
)

router = APIRouter(tags=["generate"])
ERRORS = responses(404, 413, 422, 424, 429, 503)
SSE = sse_content(StreamResponse)


def _grammar(req: GenerateRequest) -> tuple[str, dict | str] | None:
    return req.parameters.grammar.spec() if req.parameters.grammar else None


async def _generate(req: GenerateRequest, registry: RegistryDep, settings: SettingsDep,
                    request: Request) -> GenerateResponse:
    params = inference.sampling_params(req.parameters, settings)
    started = await inference.start_many(registry, settings, req.model, [req.inputs], params,
                                         req.parameters.best_of or 1, stream=False, truncate=req.parameters.truncate,
                                         grammar=_grammar(req))
    return tgi.tgi_response(started, await inference.finish_all(started, request), req.parameters)


async def _stream(req: GenerateRequest, registry: RegistryDep, settings: SettingsDep) -> StreamingResponse:
    params = inference.sampling_params(req.parameters, settings, stream=True)
    started = await inference.start(registry, settings, req.model, req.inputs, params, stream=True,
                                    truncate=req.parameters.truncate, grammar=_grammar(req))
    first = await inference.first_event(started)
    return sse_response(tgi.tgi_stream(started, first, req.parameters))


@router.post("/generate", summary="Generate text (TGI)", responses=ERRORS)
async def generate(req: GenerateRequest, registry: RegistryDep, settings: SettingsDep,
                   request: Request) -> GenerateResponse:
    return await _generate(req, registry, settings, request)


@router.post("/generate_stream", summary="Generate a stream of tokens as Server-Sent Events (TGI)",
             response_class=StreamingResponse,
             responses={200: {"content": SSE, "description": "One event per token"}, **ERRORS})
async def generate_stream(req: GenerateRequest, registry: RegistryDep, settings: SettingsDep) -> StreamingResponse:
    return await _stream(req, registry, settings)


@router.post("/", summary="TGI's compatibility route: a list of one result, or SSE when stream=true",
             response_model=list[GenerateResponse],
             responses={200: {"content": SSE, "description": "JSON list, or SSE when stream=true"}, **ERRORS})
async def compat_generate(req: CompatGenerateRequest, registry: RegistryDep, settings: SettingsDep, request: Request):
    if req.stream:
        return await _stream(req, registry, settings)
    return [await _generate(req, registry, settings, request)]


@router.post("/tokenize", summary="The tokens /generate would feed the model for `inputs` (TGI)",
             responses=responses(404, 413, 422, 503))
async def tokenize(req: GenerateRequest, registry: RegistryDep, settings: SettingsDep) -> list[SimpleToken]:
    inference.check_truncate(req.parameters.truncate, settings)
    return await inference.input_tokens(registry, req.model, req.inputs, req.parameters.truncate)


@router.post("/chat_tokenize", summary="The chat template's text for `messages`, and its tokens (TGI)",
             responses=responses(404, 413, 422, 503))
async def chat_tokenize(req: ChatRequest, registry: RegistryDep) -> ChatTokenizeResponse:
    name, text = await chat.templated(req, registry)
    tokens = await inference.input_tokens(registry, name, text, None, special=False)
    return ChatTokenizeResponse(tokenize_response=tokens, templated_text=text)
