"""The gateway's work without HTTP: episodes and their tokens, one completion, the record of each call.

Each episode has its own bearer token; a request is served and recorded only under an open episode's token.
Token ids are never re-derived from text the agent did not change, so an episode packs into one training
sequence. The engine is called as the agent loop calls it (`batching.py`); each request samples with its own
recorded seed and takes one of the episode's `max_calls` slots, its calls numbered 0..n-1 without a gap.

A request's cost is bounded before any tokenizing: one with more messages and tools than the context has
tokens, or more characters of message text than `max_chars` (the context times the longest token of the
vocabulary: no text longer can fit), is refused as over the context. An episode whose requests were refused
`max_refused` times gets 429 for any further one (the server counts them). A call whose client disconnected
before its reply was generated is not recorded (its slot is given back, as for a failed request): the agent
never saw it, so no later request can continue it, and it is not trained.
Design notes: docs/architecture.md §11 (agent_core/gateway/core.py).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from agent_core.envs.tool_env import ChatCapabilities
from agent_core.gateway.batching import DEFAULT_MAX_WAIT_S, DEFAULT_WINDOW_S, EngineQueue
from agent_core.envs.formats.hermes import TOOL_CALL_CLOSE
from agent_core.gateway.openai_format import (
    ChatRequest, Completion, chat_messages, conversation, forced_prefix, one_call_only, parse_tool_calls,
    same_assistant_turn, template_tools, tool_outcomes,
)
from agent_core.rollout.chat import encode_conversation, encode_observation_messages, eos_token_ids
from agent_core.rollout.engine import Engine, SamplingParams
from agent_core.rollout.records import json_text
from agent_core.types import ChatMessage

_SEED_STRIDE = 1_000  # calls per episode before two episodes' seeds could meet
CLIENT_GONE = 499  # the status of a request whose client disconnected (nginx's "client closed request")


class GatewayError(Exception):
    """A request refused: HTTP `status`, one-line message, OpenAI error `code`."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class GatewayCall:
    """One served completion, as the engine saw and produced it.

    prompt_ids: the ids after the chat template (or the append path, module docstring).
    finish_reason: the engine's ("stop" or "length"; a stop string counts as "stop").
    tool_calls: JSON list of the parsed calls ({name, arguments}); parse_error: why calls could
    not be read (None when they could, or no tools were offered). seed: what the call sampled with.
    """

    call_idx: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    tool_calls: str
    parse_error: str | None
    seed: int | None
    appended: bool  # its prompt was built by appending to the previous call's (module docstring)
    policy_version: int | None = None
    served_by: str | None = None
    retries: int = 0
    generated_at: float = 0.0
    generate_seconds: float = 0.0
    requested: str = "{}"  # JSON: sampling fields the request asked for that the run's settings overrode
    batch_size: int = 1  # sequences in the engine call that generated it (module docstring)
    agent: str | None = None  # which of the program's agents asked (ChatRequest.agent)


@dataclass(frozen=True)
class EpisodeCalls:
    """What an episode did through the gateway: its calls in order, and the budget that refused a
    request if one did ("max_steps": call budget, "max_context": prompt + max_tokens too long)."""

    episode_id: str
    calls: tuple[GatewayCall, ...]
    budget_hit: str | None = None
    refusal: str | None = None  # what the first refused request was told, with its numbers


@dataclass(frozen=True)
class GatewayLimits:
    """max_calls: calls an episode may make (the rollout's max_steps). max_context_tokens: prompt
    plus generated tokens per call. honor_request_sampling: use a request's temperature / top_p (an
    evaluation may); off in training, where log-probs must come from the run's sampling settings.
    batch_window_s / batch_max_wait_s: with a serial engine, how long a free engine waits for the other
    live episodes' requests before it generates for those queued: until none came for window_s, at most
    max_wait_s (agent_core/gateway/batching.py). max_refused: refused requests (400, 413) an episode may
    make before the gateway answers its every request with 429 (module docstring)."""

    max_calls: int
    max_context_tokens: int
    honor_request_sampling: bool = False
    batch_window_s: float = DEFAULT_WINDOW_S
    batch_max_wait_s: float = DEFAULT_MAX_WAIT_S
    max_refused: int = 16


@dataclass
class _Episode:
    episode_id: str
    number: int
    calls: list[GatewayCall] = field(default_factory=list)
    budget_hit: str | None = None
    refusal: str | None = None
    reserved: int = 0  # requests that hold a call slot and are not recorded yet (module docstring)
    seeds_drawn: int = 0
    refused: int = 0  # requests refused with 400 or 413 (module docstring)
    live: bool = False  # its program runs or it made a request: the engine queue may wait for its next one
    # per agent name: (messages, tools, call, reply content, reply tool_calls) of its last call
    last: dict[str | None, tuple] = field(default_factory=dict)


class GatewayCore:
    """Episodes, tokens and completions (module docstring). Thread-safe."""

    def __init__(self, engine: Engine, tokenizer, sampling: SamplingParams, limits: GatewayLimits,
                 chat: ChatCapabilities, model_name: str = "policy"):
        self.engine, self.tokenizer, self.sampling, self.limits = engine, tokenizer, sampling, limits
        self.chat, self.model_name = chat, model_name
        self.end_of_turn_ids = frozenset(eos_token_ids(tokenizer))
        self.max_chars = limits.max_context_tokens * longest_token_chars(tokenizer)  # module docstring
        self._episodes: dict[str, _Episode] = {}  # token -> open episode
        self._lock = threading.Lock()  # the episode table
        self._opened = self._live = 0
        self.engine_queue = EngineQueue(engine, self._live_episodes, limits.batch_window_s, limits.batch_max_wait_s)

    def open_episode(self, episode_id: str) -> str:
        """A new episode's bearer token."""
        token = f"agr1-{secrets.token_urlsafe(24)}"
        with self._lock:
            self._episodes[token] = _Episode(episode_id, self._opened)
            self._opened += 1
        return token

    def program_started(self, token: str) -> None:
        """The episode's program was started: the engine queue may wait for its first request."""
        with self._lock:
            self._mark_live(self._episodes[token])

    def finish_episode(self, token: str) -> EpisodeCalls:
        """The episode's calls; its token is refused from now on. KeyError for an unknown token."""
        with self._lock:
            episode = self._episodes.pop(token)
            self._live -= episode.live
        self.engine_queue.episodes_changed()
        return EpisodeCalls(episode.episode_id, tuple(episode.calls), episode.budget_hit, episode.refusal)

    def is_open(self, token: str) -> bool:
        with self._lock:
            return token in self._episodes

    def throttled(self, token: str) -> bool:
        """Whether the token's episode has had its `max_refused` requests refused (module docstring)."""
        with self._lock:
            episode = self._episodes.get(token)
            return episode is not None and episode.refused >= self.limits.max_refused

    def note_refused(self, token: str) -> None:
        """Count a request of the token's episode refused with 400 or 413."""
        with self._lock:
            if (episode := self._episodes.get(token)) is not None:
                episode.refused += 1

    def check_items(self, token: str, items: int) -> None:
        """GatewayError (400) when `items` (messages and tools) exceed the context: each renders to at least
        one token. The server asks this of a decoded body before converting it (module docstring)."""
        if items > self.limits.max_context_tokens:
            self._refuse_context(token, f"the request holds {items} messages and tools; the context has "
                                        f"{self.limits.max_context_tokens} tokens (rollout.max_context_tokens)")

    def complete(self, token: str, request: ChatRequest, gone: Callable[[], bool] = lambda: False) -> Completion:
        """Serve one request of the episode holding `token`; the reply, for any API to format. GatewayError
        for an unknown or finished token (401), a request over the episode's budgets (400), or a client
        that disconnected (`gone()` once the reply is generated: CLIENT_GONE, not recorded)."""
        episode = self._reserve(token)
        try:
            call, completion = self._generate(episode, request, self._conversation(token, request))
            if gone():
                raise GatewayError(CLIENT_GONE, "the client disconnected before its reply", "client_disconnected")
        except BaseException:
            self._release(episode)
            raise
        self._record(token, episode, call, request, completion.content, list(completion.tool_calls))
        return completion

    def _conversation(self, token: str, request: ChatRequest) -> tuple[list[ChatMessage], list[dict] | None]:
        """The request's conversation (`openai_format.conversation`), refused before any tokenizing when
        it certainly exceeds the context (module docstring)."""
        self.check_items(token, len(request.messages) + len(request.tools))
        try:
            messages, tools = conversation(request, self.chat)
        except ValueError as error:  # a call's arguments no template can write
            raise GatewayError(400, f"the chat template cannot render these messages: {error}",
                               "invalid_messages") from None
        chars = sum(len(message.content) for message in messages)
        if chars > self.max_chars:
            self._refuse_context(token, f"the messages hold {chars} characters; no more than {self.max_chars} fit "
                                        f"the context of {self.limits.max_context_tokens} tokens "
                                        "(rollout.max_context_tokens)")
        return messages, tools

    def _refuse_context(self, token: str, message: str) -> None:
        with self._lock:
            episode = self._episodes.get(token)
        if episode is None:
            raise GatewayError(401, "unknown or finished episode token (OPENAI_API_KEY)", "invalid_api_key")
        self._refuse(episode, "max_context", message)
        raise GatewayError(400, message, "context_length_exceeded")

    def _generate(self, episode: _Episode, request: ChatRequest,
                  whole: tuple[list[ChatMessage], list[dict] | None]) -> tuple[GatewayCall, Completion]:
        """The call served for `request` (its call_idx is set when recorded) and its reply. A tool_choice
        that requires a call puts the call's opening at the prompt's end (`forced_prefix`): the policy
        writes, and is trained on, only the rest."""
        prompt_ids, appended = self._prompt_ids(episode, request, whole)
        forced = forced_prefix(request)
        if forced:
            prompt_ids = [*prompt_ids, *self.tokenizer.encode(forced, add_special_tokens=False)]
        params, requested = self._params(request)
        if len(prompt_ids) + params.max_new_tokens > self.limits.max_context_tokens:
            message = (f"the prompt is {len(prompt_ids)} tokens; with max_tokens={params.max_new_tokens} it exceeds "
                       f"the context of {self.limits.max_context_tokens} tokens (rollout.max_context_tokens)")
            self._refuse(episode, "max_context", message)
            raise GatewayError(400, message, "context_length_exceeded")
        params = replace(params, seed=self._draw_seed(episode))
        served = self.engine_queue.generate(prompt_ids, params, episode.episode_id)
        generation = served.generation
        ids, logprobs, text, finish, stop = cut_at_stop(self.tokenizer, list(generation.token_ids),
                                                        list(generation.logprobs), generation.finish_reason,
                                                        request.stop)
        if one_call_only(request) and TOOL_CALL_CLOSE in forced + text:  # parallel_tool_calls false: the first call
            ids, logprobs, text, finish, _ = cut_at_stop(self.tokenizer, ids, logprobs, finish, (TOOL_CALL_CLOSE,),
                                                         keep_stop=True)
        content, tool_calls, action = parse_tool_calls(forced + text, request)
        # plain text is how an OpenAI client's agent answers: only a call that does not parse is malformed
        errors = [] if action is None else [f"{e.kind}: {e.message}" for e in action.errors if e.kind != "no_action"]
        call = GatewayCall(
            call_idx=-1, prompt_ids=prompt_ids, response_ids=ids, response_logprobs=logprobs,
            response_text=text, finish_reason=finish,
            tool_calls=json_text([{"name": c.name, "arguments": c.arguments} for c in (action.calls if action else ())]),
            parse_error="; ".join(errors) or None, seed=params.seed, appended=appended,
            policy_version=generation.policy_version, served_by=generation.served_by, retries=generation.retries,
            generated_at=time.time(), generate_seconds=round(served.seconds, 6), requested=json_text(requested),
            batch_size=served.batch_size, agent=request.agent,
        )
        tokens = tuple(self.tokenizer.decode([i]) for i in ids) if request.logprobs else ()
        return call, Completion(content, tuple(tool_calls), finish, len(prompt_ids), len(ids), tokens,
                                tuple(logprobs) if request.logprobs else (), stop)

    # ---- helpers ---------------------------------------------------------------------------------

    def _reserve(self, token: str) -> _Episode:
        """The token's episode, one of its call slots taken (module docstring); 401 / 400 as `complete`."""
        with self._lock:
            episode = self._episodes.get(token)
            if episode is None:
                raise GatewayError(401, "unknown or finished episode token (OPENAI_API_KEY)", "invalid_api_key")
            self._mark_live(episode)
            if len(episode.calls) + episode.reserved >= self.limits.max_calls:
                message = f"this episode has used its {self.limits.max_calls} calls (rollout.max_steps)"
                episode.budget_hit = episode.budget_hit or "max_steps"
                episode.refusal = episode.refusal or message
                raise GatewayError(400, message, "max_steps")
            episode.reserved += 1
            return episode

    def _release(self, episode: _Episode) -> None:
        """Give back a slot whose request failed before it was recorded."""
        with self._lock:
            episode.reserved -= 1

    def _draw_seed(self, episode: _Episode) -> int | None:
        """The episode's next seed: each drawn once (module docstring)."""
        with self._lock:
            drawn, episode.seeds_drawn = episode.seeds_drawn, episode.seeds_drawn + 1
        base = self.sampling.seed
        return None if base is None else base + episode.number * _SEED_STRIDE + drawn

    def _refuse(self, episode: _Episode, budget: str, message: str) -> None:
        with self._lock:
            episode.budget_hit = episode.budget_hit or budget
            episode.refusal = episode.refusal or message

    def _record(self, token: str, episode: _Episode, call: GatewayCall, request: ChatRequest, content: str,
                tool_calls: list[dict]) -> None:
        with self._lock:
            episode.reserved -= 1  # the slot becomes the recorded call, or is gone with the episode
            if self._episodes.get(token) is not episode:  # finished while generating: not part of it
                raise GatewayError(401, "the episode finished while this request was served", "invalid_api_key")
            self._mark_tool_outcomes(episode, request)
            episode.calls.append(replace(call, call_idx=len(episode.calls)))
            episode.last[request.agent] = (request.messages, request.tools, episode.calls[-1], content, tool_calls)

    @staticmethod
    def _mark_tool_outcomes(episode: _Episode, request: ChatRequest) -> None:
        """Each tool call of the agent's previous reply that this request answers gets `ok` (the tool
        messages the agent sends back: `tool_outcomes`), as the built-in envs record their calls'."""
        previous = episode.last.get(request.agent)
        if previous is None or not previous[4]:
            return
        outcomes = tool_outcomes(request.messages, previous[4])
        if all(ok is None for ok in outcomes):
            return
        recorded = episode.calls[previous[2].call_idx]
        entries = [{**entry, **({} if ok is None else {"ok": ok})}
                   for entry, ok in zip(json.loads(recorded.tool_calls), outcomes)]
        episode.calls[recorded.call_idx] = replace(recorded, tool_calls=json_text(entries))

    def _prompt_ids(self, episode: _Episode, request: ChatRequest,
                    whole: tuple[list[ChatMessage], list[dict] | None]) -> tuple[list[int], bool]:
        """(prompt ids, whether they extend the last call's prompt + response): module docstring. `whole`:
        the whole conversation (`_conversation`), rendered when the request does not append."""
        with self._lock:
            last = episode.last.get(request.agent)  # each agent's conversation appends to its own
        if last is not None:
            messages, tools, call, content, tool_calls = last
            n = len(messages)
            tail = request.messages[n + 1:]
            if (request.tools == tools and len(request.messages) > n + 1 and tuple(request.messages[:n]) == messages
                    and same_assistant_turn(request.messages[n], content, tool_calls)
                    and all(m["role"] in ("user", "tool") for m in tail)):
                ended = bool(call.response_ids) and call.response_ids[-1] in self.end_of_turn_ids
                glue = encode_observation_messages(self.tokenizer, chat_messages(tail, self.chat), ended,
                                                   tools=template_tools(request, self.chat))
                return [*call.prompt_ids, *call.response_ids, *glue], True
        try:
            return encode_conversation(self.tokenizer, whole[0], tools=whole[1]), False
        except ValueError as error:  # a template that cannot render this conversation
            raise GatewayError(400, f"the chat template cannot render these messages: {error}", "invalid_messages") from None

    def _params(self, request: ChatRequest) -> tuple[SamplingParams, dict]:
        """The call's sampling settings but its seed, and what the request asked for that they override."""
        base, requested = self.sampling, {}
        max_new = min(request.max_tokens or base.max_new_tokens, base.max_new_tokens)
        temperature, top_p = base.temperature, base.top_p
        if request.seed is not None:  # the run's seeding decides, so steps replay
            requested["seed"] = request.seed
        for name, value in (("temperature", request.temperature), ("top_p", request.top_p)):
            if value is not None and value != getattr(base, name):
                if self.limits.honor_request_sampling:
                    temperature, top_p = (value, top_p) if name == "temperature" else (temperature, value)
                else:
                    requested[name] = value
        if top_p <= 0:
            top_p = base.top_p
        return replace(base, max_new_tokens=max_new, temperature=temperature, top_p=top_p, seed=None,
                       prompt_seeds=None), requested

    def _mark_live(self, episode: _Episode) -> None:
        """(under self._lock)"""
        if not episode.live:
            episode.live = True
            self._live += 1

    def _live_episodes(self) -> int:
        """Open episodes whose program was started or that made a request (called by the engine
        queue, never under self._lock)."""
        with self._lock:
            return self._live


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` can stand for: its vocabulary's longest entry (a
    byte-level entry is spelt one character per byte, so never shorter than its text)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def cut_at_stop(tokenizer, ids: list[int], logprobs: list[float], finish: str, stops: tuple[str, ...],
                keep_stop: bool = False) -> tuple[list[int], list[float], str, str, str | None]:
    """(ids, log-probs, text, finish reason, the stop string hit) of a generation ended at the first stop
    string, if one occurs: the ids are kept up to the token that completes it (they were sampled; the
    text is cut before the stop string, as OpenAI returns it, or after it with `keep_stop`)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not stops or not any(stop in text for stop in stops):
        return ids, logprobs, text, finish, None
    for k in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
        hits = sorted((prefix.index(stop), stop) for stop in stops if stop in prefix)
        if hits:
            at, stop = hits[0]
            return ids[:k], logprobs[:k], prefix[:at + len(stop)] if keep_stop else prefix[:at], "stop", stop
    return ids, logprobs, text, finish, None
