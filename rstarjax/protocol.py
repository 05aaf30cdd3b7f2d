"""The tool protocol: how the policy calls the Python tool and reads its answer (rStar2-Agent
§2.1, Fig. 3), defined once.

    ...<tool_call>\\n{"name": TOOL_NAME, "arguments": {"code": "...", "input": "..."}}\\n</tool_call>
    <|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    ...<answer>\\boxed{N}</answer><|im_end|>

Every layer may import this module and it imports nothing: ``env.tools`` parses calls with these
tags, ``models.chat_template`` renders them (and the schema in the system prompt), and
``rl.agent_loop`` stops decoding on ``STOP_TOKENS`` (their ids come from the tokenizer, where
every one of them is an added token).
"""

import re

TOOL_NAME = "execute_python_code_with_standard_io"

# The function schema shown to the model in the system prompt (paper Fig. 3, made valid JSON:
# "required" sits in "parameters" and "return" in the function; see models/chat_template.py).
TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Execute Python code with standard input and capture standard output. This function "
            "takes a Python code string and an input string, provides the input string through "
            "standard input (stdin) to the code, and captures and returns any output produced "
            "through standard output (stdout). If the executed code raises an exception, the error "
            "message will be captured and returned instead."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": (
                        "A string containing Python code to be executed. The code can read from "
                        "standard input using the input() function."
                    ),
                },
                "input": {
                    "type": "string",
                    "description": (
                        "A string that will be provided as standard input to the code when it "
                        "calls input()."
                    ),
                },
            },
            "required": ["code", "input"],
        },
        "return": {
            "type": "string",
            "description": (
                "str: The output produced by the executed code through standard output. If an "
                "error occurs during execution, the error message will be returned."
            ),
        },
    },
}

# The official rStar2-Agent code's tool (repository microsoft/rStar, file
# rstar2_agent/config/tool_config/python_tool_config.yaml, "tool_schema"): the same function under
# another name and without a "return" field; the released checkpoint calls it by this name
# (profile rstar2_official, models/chat_template.RSTAR2_OFFICIAL).
OFFICIAL_TOOL_NAME = "python_code_with_standard_io"
OFFICIAL_TOOL_SCHEMA: dict = {
    "type": "function",
    "function": {
        "name": OFFICIAL_TOOL_NAME,
        "description": TOOL_SCHEMA["function"]["description"],
        "parameters": TOOL_SCHEMA["function"]["parameters"],
    },
}

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
REASON_OPEN, REASON_CLOSE = "<reason>", "</reason>"  # the reasoning the prompt asks for (paper Fig. 2)
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"  # the reward reads the \boxed{} inside
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML turn delimiters
END_OF_TEXT = "<|endoftext|>"

# A model turn ends right after any of these: the tool is dispatched the moment a call is
# complete (</tool_call>), an answer turn ends with <|im_end|>, a base model may emit EOS.
STOP_TOKENS = (TOOL_CALL_CLOSE, IM_END, END_OF_TEXT)
# The official loop (microsoft/rStar, rstar2_agent/rollout/rstar2_agent_loop.py) decodes a turn to
# the end of the assistant message and parses its calls afterwards.
OFFICIAL_STOP_TOKENS = (IM_END, END_OF_TEXT)


def closed_spans(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The text between each ``open_tag`` and the first ``close_tag`` after it, in order, each
    span starting after the previous one's close: what ``re.findall(open.*?close, text,
    re.DOTALL)`` returns with both tags escaped, in time linear in the text. (That regex tries
    every open tag against the rest of the text, so a degenerate response repeating an open tag
    with no close after it took seconds to parse: 3.3 s for 8,000 ``<tool_call>`` tokens.)"""
    spans, start = [], text.find(open_tag)
    while start >= 0:
        body = start + len(open_tag)
        end = text.find(close_tag, body)
        if end < 0:  # no close after this open, so none after any later one
            break
        spans.append(text[body:end])
        start = text.find(open_tag, end + len(close_tag))
    return spans


def tool_call_bodies(text: str) -> list[str]:
    """The body of every complete ``<tool_call>...</tool_call>`` block in ``text``, in order."""
    return closed_spans(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


# ---- how an integer answer may be written ------------------------------------------------------
# LaTeX's spaces ("1\,000", "1~000", "1\ 000"), read as one plain space
_LATEX_SPACES = re.compile(r"(?:\\[,;: ]|~|\\thinspace\b|\\enspace\b|\s)+")
# SI-style thousands groups: "1 000", "-12 345 678"
_GROUPED_BY_SPACE = re.compile(r"[+-]?\d{1,3}(?: \d{3})+", re.ASCII)


def join_space_groups(text: str) -> str:
    """``text`` with LaTeX's spaces as single plain ones and, when the whole text is an
    SI-style grouped integer ("1\\,000", "1 000 000"), the group spaces removed."""
    s = _LATEX_SPACES.sub(" ", text).strip()
    return s.replace(" ", "") if _GROUPED_BY_SPACE.fullmatch(s) else s
