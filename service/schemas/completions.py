"""OpenAI's (legacy) completions shapes (/v1/completions): a raw prompt in, text out."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from .openai import MAX_N, OpenAIRequest, OpenAIResponse, Usage

MAX_PROMPTS = 32
Prompts = Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]       # a prompt as token ids
TokenPrompts = Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class CompletionRequest(OpenAIRequest):
    max_tokens: int | None = Field(None, ge=0, description="New tokens at most (default: the model's "
                                   "generation_config max_new_tokens, else WCODEC_DEFAULT_MAX_NEW_TOKENS); 0 "
                                   "with echo: the prompt alone, scored with logprobs.")
    prompt: str | Prompts | TokenIds | TokenPrompts = Field(
        description=f"A prompt, or up to {MAX_PROMPTS} (`n` choices each, all batched together); each a text or "
                    "the model's token ids (as evaluation harnesses send them; not tokenized again).",
        examples=["The capital of France is"])
    echo: bool = Field(False, description="Put the prompt before the completion.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Each generated token's log-probability, and "
                                                               "with 1-5 that many most likely tokens at each "
                                                               "position (top_logprobs); with echo, the prompt's "
                                                               "tokens' too (null for the first).")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Candidates generated for each prompt; the "
                                "`n` whose tokens' mean log-probability is highest are returned, best first "
                                "(at least `n`; not with a stream; usage counts every candidate's tokens).")
    suffix: str | None = Field(None, description="Not supported: must be empty.")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else p

    def candidates(self) -> int:
        """Sequences generated a prompt: best_of, or n."""
        return max(self.best_of or 1, self.choices())

    def unsupported(self) -> dict[str, str]:
        bad = super().unsupported()
        if self.best_of is not None and self.best_of < self.choices():
            bad["best_of"] = f"must be at least n ({self.choices()})"
        elif (self.best_of or 1) > 1 and self.stream:
            bad["best_of"] = "best_of > 1 cannot be streamed"
        bad |= {"suffix": "not supported: must be empty"} if self.suffix else {}
        if self.max_tokens == 0 and not self.echo:
            bad["max_tokens"] = "0 needs echo (the prompt alone is returned)"
        return bad

    def prompt_logprobs(self) -> int | None:
        """The prompt's scores the engine computes: with echo and logprobs."""
        return self.logprobs if self.echo else None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="each token's text; where its bytes are not UTF-8 on their own (a piece "
                                          "of a character), 'bytes:' and the bytes, \\xNN escaped (OpenAI's form)")
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="at each position the `logprobs` most "
                                                                    "likely tokens and the chosen one (so up to "
                                                                    "logprobs + 1, as OpenAI's), keyed as `tokens`; "
                                                                    "a token whose key another already has: "
                                                                    "'token_id:<id>'; null for an echoed prompt's "
                                                                    "first token")
    text_offset: list[int] = Field(description="each token's first character in `text`")

    def __add__(self, more: "CompletionLogprobs") -> "CompletionLogprobs":
        """These tokens, then `more`'s (its offsets already in this text)."""
        return CompletionLogprobs(tokens=self.tokens + more.tokens, token_logprobs=self.token_logprobs + more.token_logprobs,
                                  top_logprobs=self.top_logprobs + more.top_logprobs,
                                  text_offset=self.text_offset + more.text_offset)


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = Field(description="None until a stream's last chunk")


class Completion(OpenAIResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice] = Field(description="one per prompt (empty in a stream's usage chunk)")
    usage: Usage | None = Field(None, description="always on a response; in a stream, only in the last chunk, "
                                                  "with stream_options.include_usage")
