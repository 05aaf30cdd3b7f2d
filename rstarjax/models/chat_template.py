"""The rStar2-Agent chat template (paper Fig. 3, §2.1), string-level and id-level.

Layout (ChatML, as Qwen; `{...}` are fillers)::

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n
    <|im_start|>user\\n{USER_PROMPT_PREFIX}{question}<|im_end|>\\n
    <|im_start|>assistant\\n                                      <- end of render_prompt()
    {reason...}<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call><|im_end|>    <- model
    \\n<|im_start|>user\\n<tool_response>\\n{tool output}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                      <- render_tool_response_turn()
    {reason...}<answer>\\boxed{N}</answer><|im_end|>                                     <- model

Turn boundaries (the rollout appends ids turn by turn and never re-tokenizes, so SFT must
tokenize the same way): a model turn starts right after "<|im_start|>assistant\\n" and ends with
the <|im_end|> it generated; the "\\n" after <|im_end|> belongs to the next template piece. Both
cuts are clean for the BPE: an added token always splits the pre-tokenizer, and "assistant\\n"
followed by a non-whitespace character splits there too (letters never absorb a newline). So
`tokenizer.encode(render_conversation(m)) == encode_conversation(tok, m).ids ==` the rollout's
concatenation, provided no assistant content starts with a line break, possibly after other
whitespace (the "\\n\\n" run would merge across the cut): `render_conversation` rejects those
with a ValueError.

Untrusted text (the question, tool output, later user turns) is plain text in the id-level
helpers: a program printing "<|im_end|>" cannot forge a turn. For such text the string-level
render then `encode` differs (by design); for all other text the two agree. Template text
(system prompt, whose "<tool_call>" examples are real added tokens as in Qwen's template) is not.

Deviations from Fig. 3 (the figure is OCR'd and garbled in places):
- "<jim_start>"/"<jim_end>" are <|im_start|>/<|im_end|>.
- No "<think>" after the assistant prompt. The prompt asks for <reason>...</reason> as the
  reasoning delimiter, every assistant turn in the paper's traces (Figs. 10, 11) starts directly
  with <reason> after "<|im_start|>assistant", an opened <think> is never closed in those traces,
  and in a small-vocab demo model <think> is an untrained embedding. A lone "<think>" in Fig. 3
  is most likely Qwen3's own thinking-mode generation prompt leaking into the figure.
- The tool block uses Qwen's function-calling layout with its newlines ("# Tools\\n\\nYou may
  call...", one JSON schema per line inside <tools>, "<tool_call>\\n{...}\\n</tool_call>") — the
  layout Qwen base/instruct models have seen and the one in the paper's traces (Figs. 10, 11);
  Fig. 3's line breaks are page wrapping.
- The schema is valid JSON: Fig. 3 puts "required"/"return" inside "properties" (unbalanced
  braces); here "required": ["code", "input"] sits in "parameters" and "return" in the function.
- Tool calls follow the assistant text directly ("</reason><tool_call>", as Fig. 11), several
  calls in one turn are separated by "\\n"; consecutive tool results share one user turn, each
  in its own <tool_response> block (Qwen's convention).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rstarjax.protocol import (IM_END, IM_START, OFFICIAL_TOOL_NAME, OFFICIAL_TOOL_SCHEMA, REASON_OPEN,
                               TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_NAME, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                               TOOL_SCHEMA)

SYSTEM_INTRO = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The Assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer. The reasoning process and answer are enclosed within <reason> </reason> "
    "and <answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason>"
    "<answer> answer here </answer>."
)

# Qwen's function-calling block, one JSON schema per line (json.dumps as Jinja's `tojson` in
# transformers writes it: ensure_ascii=False, default separators, keys in their own order).
_TOOLS_HEADER = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_block(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The text after the system intro that lists the tools' JSON schemas."""
    return _TOOLS_HEADER + "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas) + _TOOLS_FOOTER


SYSTEM_PROMPT = SYSTEM_INTRO + tools_block([TOOL_SCHEMA])

USER_PROMPT_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem: "
)

COMPACT_SYSTEM_PROMPT = (
    "Reason in <reason></reason>, answer in <answer></answer>. Run Python with <tool_call>\n"
    '{"name": "' + TOOL_NAME + '", "arguments": {"code": "...", "input": ""}}\n</tool_call>'
)
COMPACT_USER_PROMPT_PREFIX = "Put the answer in \\boxed{}.\n"


# The official rStar2-Agent chat template (repository microsoft/rStar, file
# rstar2_agent/config/rstar2_agent_trainer.yaml, actor_rollout_ref.model.custom_chat_template),
# rendered with tools=[OFFICIAL_TOOL_SCHEMA] and add_generation_prompt=True: its system text, its
# user prefix (ending in a newline), and "<reason>" written after every "<|im_start|>assistant\n".
OFFICIAL_SYSTEM_INTRO = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <reason> </reason> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer "
    "here </answer>."
)
OFFICIAL_USER_PROMPT_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\n"
    "This is the problem:\n"
)
OFFICIAL_GENERATION_PREFILL = REASON_OPEN


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """The fixed texts of a prompt and the layout of the turns. RSTAR2 is paper Fig. 3; COMPACT
    keeps the same structure and tool-call syntax in ~60 tokens (Qwen3 vocab; ~85 with 3000 ranks)
    for tiny demo models with a ~512-token budget; RSTAR2_OFFICIAL is what the official code
    shows the model (see ``official_layout``)."""

    system_prompt: str = SYSTEM_PROMPT
    user_prompt_prefix: str = USER_PROMPT_PREFIX
    # the tool names the parser accepts (env.tools.parse_tool_call(text, fmt.tool_names))
    tool_names: tuple[str, ...] = (TOOL_NAME,)
    # official_layout=True is the official loop's protocol: the model's turn runs to its own
    # <|im_end|> (the engine does not stop at </tool_call>), the tool turn follows that <|im_end|>
    # directly and ends with "<|im_end|>\n" (the newline closes a turn instead of opening the next),
    # every generation prompt is followed by ``generation_prefill``, a leading system message
    # replaces only ``system_intro`` (the tools block stays), and tool calls in rendered
    # conversations each start on a new line (the official template's layout).
    official_layout: bool = False
    generation_prefill: str = ""
    system_intro: str = ""  # official_layout: the system text before the tools block
    tool_schemas: tuple = ()  # official_layout: the schemas of the tools block
    # env.tools.TOOL_PROTOCOLS: which calls run and what the model reads back in <tool_response>:
    # "paper" (our parser and responses) or "code_judge" (the official code's: env/code_judge.py)
    tool_protocol: str = "paper"

    @property
    def stops_at_tool_call(self) -> bool:
        """Whether the engine ends a model turn at </tool_call> (paper layout) or only at the end
        of the assistant message (the official loop, which parses the calls afterwards)."""
        return not self.official_layout


RSTAR2 = ChatFormat()
COMPACT = ChatFormat(COMPACT_SYSTEM_PROMPT, COMPACT_USER_PROMPT_PREFIX)
RSTAR2_OFFICIAL = ChatFormat(
    system_prompt=OFFICIAL_SYSTEM_INTRO + tools_block([OFFICIAL_TOOL_SCHEMA]),
    user_prompt_prefix=OFFICIAL_USER_PROMPT_PREFIX, tool_names=(OFFICIAL_TOOL_NAME,), official_layout=True,
    generation_prefill=OFFICIAL_GENERATION_PREFILL, system_intro=OFFICIAL_SYSTEM_INTRO,
    tool_schemas=(OFFICIAL_TOOL_SCHEMA,), tool_protocol="code_judge")
# the names configs use (rl/sft/eval.chat_format)
CHAT_FORMATS = {"rstar2": RSTAR2, "compact": COMPACT, "rstar2_official": RSTAR2_OFFICIAL}


def chat_format(name: str) -> ChatFormat:
    """The ChatFormat a config names."""
    if name not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {sorted(CHAT_FORMATS)}, got {name!r}")
    return CHAT_FORMATS[name]


def offered_tools(fmt: ChatFormat) -> tuple[Mapping[str, Any], ...]:
    """The tool schemas fmt's prompts offer (one per name of ``fmt.tool_names``): the official
    layout's tools block; the paper formats offer the paper's python tool (RSTAR2 lists its schema,
    COMPACT describes the same tool in one line)."""
    if fmt.tool_schemas:
        return tuple(fmt.tool_schemas)
    return tuple(s for s in (TOOL_SCHEMA,) if s["function"]["name"] in fmt.tool_names)



class TokenizerLike(Protocol):
    added_token_ids: Mapping[str, int]

    def encode(self, text: str) -> list[int]: ...
    def encode_ordinary(self, text: str) -> list[int]: ...
    def token_id(self, token: str) -> int: ...


@dataclasses.dataclass(frozen=True)
class Piece:
    """A span of a rendered conversation.

    special: the text is one added token placed by the template (or the model's <|im_end|>).
    assistant: generated by the model (SFT loss mask 1). Assistant text is its own tokenization
      unit and may contain added tokens (the model emits <tool_call> etc.).
    trusted: template text (system prompt, user prefix, role names): added tokens written in it
      are real ones. Untrusted text (question, tool output, later user turns) is plain text.
    Non-assistant text between two added tokens / assistant pieces is one tokenization unit.
    """

    text: str
    special: bool = False
    assistant: bool = False
    trusted: bool = True


def _special(token: str, assistant: bool = False) -> Piece:
    return Piece(token, special=True, assistant=assistant)


def _text(text: str) -> Piece:
    return Piece(text)


def _data(text: str) -> Piece:
    return Piece(text, trusted=False)


# ---- pieces -----------------------------------------------------------------------------------
# Two layouts of the same ChatML text. Paper (RSTAR2, COMPACT): a turn is closed by <|im_end|> and
# the "\n" opens the next turn. Official (fmt.official_layout): a template turn is closed by
# "<|im_end|>\n", while the model's own <|im_end|> is followed directly by the next turn, as the
# official loop appends it. Prompts render to the same string in both.
def _turn_open(role: str, fmt: ChatFormat, first: bool = False) -> list[Piece]:
    newline_before = not first and not fmt.official_layout
    return ([_text("\n")] if newline_before else []) + [_special(IM_START), _text(role + "\n")]


def _turn_close(fmt: ChatFormat) -> list[Piece]:
    """The end of a template (non-model) turn."""
    return [_special(IM_END)] + ([_text("\n")] if fmt.official_layout else [])


def _system_text(fmt: ChatFormat, custom: str | None) -> str:
    """The system turn's text: fmt's, or a conversation's own system message (which, in the
    official layout, replaces the intro before the tools block, as the official template does)."""
    if custom is None:
        return fmt.system_prompt
    if fmt.official_layout:
        return custom + tools_block(fmt.tool_schemas)
    return custom


def _system_user_pieces(system: str, user_prefix: str, question: str, fmt: ChatFormat) -> list[Piece]:
    return (
        _turn_open("system", fmt, first=True) + [_text(system)] + _turn_close(fmt)
        + _turn_open("user", fmt) + [_text(user_prefix), _data(question)] + _turn_close(fmt)
    )


def _generation_prompt_pieces(fmt: ChatFormat = RSTAR2) -> list[Piece]:
    prefill = [_text(fmt.generation_prefill)] if fmt.generation_prefill else []
    return _turn_open("assistant", fmt) + prefill


def _tool_responses_pieces(texts: Sequence[str], fmt: ChatFormat) -> list[Piece]:
    pieces = _turn_open("user", fmt)[:-1] + [_text("user")]  # "user" without its newline: one per block
    for text in texts:
        pieces += [_text("\n"), _special(TOOL_RESPONSE_OPEN), _text("\n"), _data(text), _text("\n"),
                   _special(TOOL_RESPONSE_CLOSE)]
    return pieces + _turn_close(fmt)


def prompt_pieces(question: str, fmt: ChatFormat = RSTAR2) -> list[Piece]:
    _check_str("question", question)
    return (_system_user_pieces(fmt.system_prompt, fmt.user_prompt_prefix, question, fmt)
            + _generation_prompt_pieces(fmt))


def tool_response_turn_pieces(texts: str | Sequence[str], close_assistant_turn: bool = False,
                              fmt: ChatFormat = RSTAR2) -> list[Piece]:
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("a tool response turn needs at least one tool output")
    for t in texts:
        _check_str("tool output", t)
    # An engine that stops at </tool_call> has not emitted <|im_end|>: the template closes the turn.
    close = [_special(IM_END)] if close_assistant_turn else []
    return close + _tool_responses_pieces(texts, fmt) + _generation_prompt_pieces(fmt)


def format_tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """'<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>' (JSON args verbatim if str)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{TOOL_CALL_CLOSE}'


# The pre-tokenizer's `\s*[\r\n]+` would join "assistant\n" with such a start; anything else
# (a letter, a digit, "<", spaces then a non-space) starts a new pre-token.
_MERGES_WITH_PROMPT_NEWLINE = re.compile(r"\s*[\r\n]")


def _assistant_content(message: Mapping[str, Any]) -> str:
    """An assistant message's text: a str, or None / absent for a turn of tool calls only (0,
    False or [] are not text: ``or ""`` trained them as an empty turn)."""
    content = message.get("content")
    if content is None:
        return ""
    _check_str("assistant content", content)
    return content


def _tool_calls(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An assistant message's ``tool_calls``: a list of mappings (None / absent: none)."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list) or not all(isinstance(c, Mapping) for c in calls):
        raise TypeError(f"tool_calls must be a list of {{'function': {{'name', 'arguments'}}}} objects, got {calls!r:.80}")
    return calls


def _checked_tool_call(call: Mapping[str, Any], fmt: ChatFormat) -> tuple[str, Mapping[str, Any] | str]:
    """(name, arguments) of one tool call, refused unless the format's parser would run it: a name
    of ``fmt.tool_names`` and a JSON object of arguments (or a JSON string of one, OpenAI's way).
    Any other call is text the rollout's parser answers with an error: training it teaches
    calls that never run."""
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or "name" not in fn or "arguments" not in fn:
        raise ValueError(f"a tool call needs 'name' and 'arguments': {call!r}")
    name, arguments = fn["name"], fn["arguments"]
    if name not in fmt.tool_names:
        raise ValueError(f"tool call {name!r}: this chat format's tool is {' / '.join(map(repr, fmt.tool_names))} "
                         "(the only one its prompts offer and its parser runs)")
    parsed = arguments
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"tool call {name!r}: arguments are a string that is not JSON ({e})") from None
    if not isinstance(parsed, Mapping):
        raise ValueError(f"tool call {name!r}: arguments must be a JSON object, got {type(parsed).__name__}")
    return name, arguments


def _assistant_text(message: Mapping[str, Any], fmt: ChatFormat = RSTAR2) -> str:
    content = _assistant_content(message)
    calls = [format_tool_call(*_checked_tool_call(call, fmt)) for call in _tool_calls(message)]
    # the official template starts every call on a new line; the paper's traces put the first
    # call right after the text (Fig. 11)
    text = content + "".join("\n" + c for c in calls) if fmt.official_layout else content + "\n".join(calls)
    if not text:
        raise ValueError("an assistant message needs content or tool_calls")
    # In the official layout the model's text follows the prefill "<reason>", whose ">" the
    # pre-tokenizer joins with most next characters: there turn-by-turn ids (the rollout's, and
    # encode_conversation's) and the ids of the whole rendered string differ by design.
    if not fmt.official_layout and _MERGES_WITH_PROMPT_NEWLINE.match(text):
        raise ValueError(
            "assistant content must not start with a line break (after optional whitespace): it "
            "would merge with the newline of '<|im_start|>assistant\\n' when the conversation is "
            "tokenized as one string, while the rollout tokenizes turn by turn "
            f"(content starts {text[:20]!r})"
        )
    return text


def conversation_pieces(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, fmt: ChatFormat = RSTAR2
) -> list[Piece]:
    """OpenAI-style messages -> pieces. An optional leading system message replaces fmt's system
    prompt (in the official layout: its intro); the first user message is the question (after fmt's
    user prefix); later user messages are verbatim; role="tool" messages become <tool_response>
    blocks of one user turn. In the official layout an assistant message's content is what the
    model wrote after the prefill, as in the rollouts."""
    messages = list(messages)
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"message {i}: role must be system/user/assistant/tool, got {m!r:.80}")
    # (message numbers in errors are places in the row's own list, the system message counted)
    custom_system = None
    first = 0
    if messages and messages[0]["role"] == "system":  # its text must be a str: "" is a chosen empty
        custom_system = _content(messages[0], 0)  # prompt, a null or missing content is not
        first = 1
    if len(messages) <= first or messages[first]["role"] != "user":
        raise ValueError("the conversation must start with the user's question (after an optional system)")
    pieces = _system_user_pieces(_system_text(fmt, custom_system), fmt.user_prompt_prefix,
                                 _content(messages[first], first), fmt)
    i = first + 1
    while i < len(messages):
        role = messages[i]["role"]
        if role == "assistant":
            pieces += _generation_prompt_pieces(fmt)
            try:
                text = _assistant_text(messages[i], fmt)
            except (TypeError, ValueError) as e:
                raise type(e)(f"message {i} (assistant): {e}") from None
            pieces += [Piece(text, assistant=True), _special(IM_END, assistant=True)]
            i += 1
        elif role == "tool":
            if messages[i - 1]["role"] != "assistant" or not messages[i - 1].get("tool_calls"):
                raise ValueError(f"message {i}: a tool result must follow an assistant message with tool_calls")
            j = i
            while j < len(messages) and messages[j]["role"] == "tool":
                j += 1
            pieces += _tool_responses_pieces([_content(messages[k], k) for k in range(i, j)], fmt)
            i = j
        elif role == "user":
            pieces += _turn_open("user", fmt) + [_data(_content(messages[i], i))] + _turn_close(fmt)
            i += 1
        else:
            raise ValueError(f"message {i}: a system message is only allowed first")
    if add_generation_prompt:
        pieces += _generation_prompt_pieces(fmt)
    elif not (fmt.official_layout and messages[-1]["role"] != "assistant"):
        pieces.append(_text("\n"))  # ChatML closes every turn with a newline
    return pieces


# ---- string level -----------------------------------------------------------------------------
def render(pieces: Sequence[Piece]) -> str:
    return "".join(p.text for p in pieces)


def render_prompt(question: str, fmt: ChatFormat = RSTAR2) -> str:
    """System prompt + user question + assistant generation prompt (paper Fig. 3)."""
    return render(prompt_pieces(question, fmt))


def render_tool_response_turn(texts: str | Sequence[str], close_assistant_turn: bool = False,
                              fmt: ChatFormat = RSTAR2) -> str:
    """What the rollout appends after a model turn that ended with <|im_end|> (or, with
    close_assistant_turn=True, one that stopped at </tool_call>): the tool output(s) as a user turn
    in <tool_response> blocks, then the next assistant generation prompt (fmt's layout)."""
    return render(tool_response_turn_pieces(texts, close_assistant_turn, fmt))


def render_conversation(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, fmt: ChatFormat = RSTAR2
) -> str:
    """SFT rendering of OpenAI-style messages (assistant tool_calls, role="tool" results)."""
    return render(conversation_pieces(messages, add_generation_prompt, fmt))


# ---- id level ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _added_token_splitter(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def encode_pieces(tokenizer: TokenizerLike, pieces: Sequence[Piece]) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, bool assistant mask). Equals `tokenizer.encode(render(pieces))` whenever the
    untrusted text holds no added-token string: added tokens cut the BPE pre-tokenizer, so the
    text between them is encoded unit by unit; assistant text is its own unit (see module doc)."""
    splitter = _added_token_splitter(tuple(tokenizer.added_token_ids))
    ids: list[int] = []
    mask: list[bool] = []
    run: list[str] = []

    def flush():
        if run:
            new = tokenizer.encode_ordinary("".join(run))
            ids.extend(new)
            mask.extend([False] * len(new))
            run.clear()

    def add_special(token: str, assistant: bool):
        flush()
        ids.append(tokenizer.token_id(token))
        mask.append(assistant)

    for p in pieces:
        if p.special:
            add_special(p.text, p.assistant)
        elif p.assistant:
            flush()
            new = tokenizer.encode(p.text)
            ids.extend(new)
            mask.extend([True] * len(new))
        elif p.trusted:
            for k, part in enumerate(splitter.split(p.text)):
                if k % 2:  # re.split puts the captured added tokens at odd positions
                    add_special(part, False)
                elif part:
                    run.append(part)
        else:
            run.append(p.text)
    flush()
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


def encode_prompt(tokenizer: TokenizerLike, question: str, fmt: ChatFormat = RSTAR2) -> list[int]:
    """Prompt ids for the rollout (the question's text can never produce an added token)."""
    return encode_pieces(tokenizer, prompt_pieces(question, fmt))[0].tolist()


def encode_tool_response_turn(
    tokenizer: TokenizerLike, texts: str | Sequence[str], close_assistant_turn: bool = False,
    fmt: ChatFormat = RSTAR2,
) -> list[int]:
    """Ids the rollout appends after a model turn (see render_tool_response_turn); the tool output
    is plain text even if it prints "<|im_end|>"."""
    return encode_pieces(tokenizer, tool_response_turn_pieces(texts, close_assistant_turn, fmt))[0].tolist()


@dataclasses.dataclass
class EncodedConversation:
    ids: np.ndarray  # int32[n]
    assistant_mask: np.ndarray  # bool[n]: SFT loss on these target tokens


def encode_conversation(
    tokenizer: TokenizerLike,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    fmt: ChatFormat = RSTAR2,
) -> EncodedConversation:
    ids, mask = encode_pieces(tokenizer, conversation_pieces(messages, add_generation_prompt, fmt))
    return EncodedConversation(ids, mask)


# ---- helpers ----------------------------------------------------------------------------------
def _check_str(what: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")


def _content(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if not isinstance(content, str):
        raise TypeError(f"message {index} ({message.get('role')}): content must be a str, got {type(content).__name__}")
    return content


def _jinja_string(s: str) -> str:
    # A JSON string literal (ASCII-only) is a valid Jinja string literal with the same value.
    return json.dumps(s, ensure_ascii=True)


def jinja_chat_template(fmt: ChatFormat = RSTAR2) -> str:
    """The same template as conversation_pieces(), for HF `apply_chat_template` (saved into
    tokenizer_config.json by Tokenizer.save_pretrained); tests/test_chat_template.py checks that
    transformers renders exactly what render_conversation renders."""
    if fmt.official_layout:
        return _official_layout_jinja(fmt)
    return (
        "{%- set default_system = " + _jinja_string(fmt.system_prompt) + " %}"
        "{%- set user_prefix = " + _jinja_string(fmt.user_prompt_prefix) + " %}"
        "{%- if messages[0].role == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>' }}"
        "{%- set start = 1 %}"
        "{%- else %}"
        "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>' }}"
        "{%- set start = 0 %}"
        "{%- endif %}"
        "{%- set ns = namespace(seen_question=false) %}"
        "{%- for message in messages[start:] %}"
        "{%- if message.role == 'user' %}"
        "{{- '\\n<|im_start|>user\\n' }}"
        "{%- if not ns.seen_question %}{{- user_prefix }}{%- set ns.seen_question = true %}{%- endif %}"
        "{{- message.content + '<|im_end|>' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '\\n<|im_start|>assistant\\n' }}"
        "{%- if message.content %}{{- message.content }}{%- endif %}"
        "{%- if message.tool_calls %}"
        "{%- for tool_call in message.tool_calls %}"
        "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
        "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '\\n<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>' }}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '\\n<|im_start|>assistant\\n' }}{%- else %}{{- '\\n' }}{%- endif %}"
    )


def _official_layout_jinja(fmt: ChatFormat) -> str:
    """jinja_chat_template for the official layout. `tools=[...]` given to apply_chat_template
    replace fmt's schemas in the tools block, as in the official template; without them the
    block lists fmt's own (the model was only ever shown a prompt with the tools block)."""
    tool_call = '<tool_call>\\n{"name": "'
    return (
        "{%- set default_intro = " + _jinja_string(fmt.system_intro) + " %}"
        "{%- set default_tools = " + _jinja_string("".join("\n" + json.dumps(t, ensure_ascii=False)
                                                             for t in fmt.tool_schemas)) + " %}"
        "{%- set user_prefix = " + _jinja_string(fmt.user_prompt_prefix) + " %}"
        "{%- set prefill = " + _jinja_string(fmt.generation_prefill) + " %}"
        "{{- '<|im_start|>system\\n' }}"
        "{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- set start = 1 %}"
        "{%- else %}{{- default_intro }}{%- set start = 0 %}{%- endif %}"
        "{{- " + _jinja_string(_TOOLS_HEADER) + " }}"
        "{%- if tools %}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
        "{%- else %}{{- default_tools }}{%- endif %}"
        "{{- " + _jinja_string(_TOOLS_FOOTER + IM_END + "\n") + " }}"
        "{%- set ns = namespace(seen_question=false) %}"
        "{%- for message in messages[start:] %}"
        "{%- if message.role == 'user' %}"
        "{{- '<|im_start|>user\\n' }}"
        "{%- if not ns.seen_question %}{{- user_prefix }}{%- set ns.seen_question = true %}{%- endif %}"
        "{{- message.content + '<|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' + prefill }}"
        "{%- if message.content %}{{- message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls or [] %}"
        "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\\n" + tool_call + "' + tool_call.name + '\", \"arguments\": ' }}"
        "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
        "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
        "{{- '}\\n</tool_call>' }}"
        "{%- endfor %}"
        "{{- '<|im_end|>' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
        "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' + prefill }}"
        "{%- elif messages[-1].role == 'assistant' %}{{- '\\n' }}{%- endif %}"
    )


JINJA_CHAT_TEMPLATE = jinja_chat_template(RSTAR2)
