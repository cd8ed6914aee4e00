"""OpenAI's chat completions shapes (/v1/chat/completions)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from .openai import OpenAIRequest, OpenAIResponse, Usage

MAX_TOP_LOGPROBS = 20                           # OpenAI's bound on top_logprobs (vLLM's max_logprobs default)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class InputMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="'developer' is 'system'")
    content: str | list[TextPart] = Field(description="Text, or a list of text parts (joined).")

    def for_template(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict = Field(alias="schema", description="The JSON schema the message's content follows.")
    strict: bool | None = None


FORMATS = ("text", "json_object", "json_schema", "json", "regex")


class ResponseFormat(BaseModel):
    type: str = Field(description="OpenAI's 'text', 'json_object' (the content is a JSON object) or "
                                  "'json_schema' (it follows `json_schema.schema`); TGI's 'json' or "
                                  "'json_object' with a schema in `value`, or 'regex' with a pattern in `value`.")
    json_schema: JsonSchemaFormat | None = None
    value: dict | str | None = Field(None, description="TGI's form: the schema or the regex.")

    def spec(self) -> tuple[str, dict | str] | None:
        """('schema', a JSON schema) or ('regex', a pattern) the content follows; None: free text."""
        if self.type == "json_schema":
            return "schema", self.json_schema.schema_
        if self.type in ("json_object", "json"):
            return "schema", self.value if self.value is not None else {"type": "object"}
        return ("regex", self.value) if self.type == "regex" else None

    def unsupported(self) -> str | None:
        if self.type not in FORMATS:
            return f"one of {', '.join(FORMATS)}, not {self.type!r}"
        if self.type == "json_schema" and not self.json_schema:
            return "'json_schema' needs `json_schema`"
        return "'regex' needs a pattern in `value`" if self.type == "regex" and not isinstance(self.value, str) else None


class ChatRequest(OpenAIRequest):
    messages: list[InputMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="The newer name of `max_tokens`.")
    logprobs: bool | None = Field(None, description="Each generated token's log-probability, in "
                                                    "`choices[].logprobs.content`.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With `logprobs: true`, the "
                                     "most likely tokens at each position, in `logprobs.content[].top_logprobs`.")
    response_format: ResponseFormat | None = Field(None, description="{'type': 'text'}, {'type': 'json_object'}, "
                                                   "{'type': 'json_schema', 'json_schema': {'name', 'schema'}}, or "
                                                   "TGI's {'type': 'json' | 'json_object' | 'regex', 'value': ...}: "
                                                   "the content constrained to it (TGI's grammar).")
    tools: list[dict] | None = Field(None, description="Not supported: must be empty.")
    tool_choice: str | dict | None = Field(None, description="Not supported: 'none' only.")
    functions: list[dict] | None = Field(None, description="Not supported: must be empty.")
    function_call: str | dict | None = Field(None, description="Not supported: 'none' only.")
    parallel_tool_calls: bool | None = Field(None, description="Accepted; there are no tools.")

    def unsupported(self) -> dict[str, str]:
        bad = super().unsupported()
        bad |= {"top_logprobs": "needs `logprobs: true`"} if self.top_logprobs and not self.logprobs else {}
        bad |= {f: "tools and function calling are not supported" for f in ("tools", "functions") if getattr(self, f)}
        bad |= {f: "tools and function calling are not supported" for f in ("tool_choice", "function_call")
                if getattr(self, f) not in (None, "none")}
        if self.response_format and (why := self.response_format.unsupported()):
            bad["response_format"] = why
        return bad

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def new_tokens_field(self) -> str:
        """The field `new_tokens` came from, which an error about it names."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def top_n(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str = Field(description="the token's text; where its bytes are not UTF-8 on their own (a piece of "
                                   "a character), 'bytes:' and the bytes, \\xNN escaped (OpenAI's form)")
    logprob: float
    bytes: list[int] | None = Field(description="the token's own bytes (of a piece of a character, that piece): "
                                                "the content's tokens' bytes, joined, are the content's UTF-8")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely tokens at this position, "
                                                       "most likely first, each token its own entry")


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = Field(description="the tokens of the message's content (those "
                                                               "whose first character is in it)")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`")


class ChatCompletion(OpenAIResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: ChatLogprobs | None = Field(None, description="with `logprobs: true`: the tokens of this delta")


class ChatCompletionChunk(OpenAIResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice] = Field(description="empty in the usage chunk")
    usage: Usage | None = Field(None, description="only in the last chunk, with stream_options.include_usage")
