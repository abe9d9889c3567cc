"""Tool calling: the functions a model may call, how they are shown to it, and its calls read back.

- `Tool` (name, description, parameters as a JSON Schema object). `check_tool` and `read_tools` check
  a client's functions against the bounds table and llguidance; a refusal is a `BoundError` naming it.
- `ToolChoice` (`AUTO`, `NONE`, `REQUIRED`, `ToolChoice.named(name)`) and `read_choice`.
- `CallSyntax`: how a model writes a call. `HERMES` is `<tool_call>\\n{"name": ..., "arguments": ...}
  \\n</tool_call>` (Qwen's, and the fallback's); `LLAMA3` is bare `{"name": ..., "parameters": ...}`.
  `template_syntax(tokenizer)` is the chat template's, None where it takes no tools.
- `tool_call_format(tools, choice, syntax)`: the `OutputFormat` a reply must match. Each call's
  arguments follow its function's schema while decoding, so they always parse and validate.
- `encode_tool_chat(tokenizer, messages, tools)`: the prompt. A template that takes tools renders them;
  otherwise `fallback_block` describes them in the system message, and calls and results are text.
- `parse_tool_calls(text, tools, syntax)` reads a whole reply; `CallReader` reads a streamed one.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from ..engine.backend import Tokenizer
from ..engine.output_format import JSON_OPTIONS, TEXT, OutputFormat, OutputFormatError
from . import bounds as B
from .chat import ChatPrompt
from .declare import require_chat_template

JSONObject = dict[str, object]
NAME = re.compile(r"[A-Za-z0-9_-]+")  # OpenAI's function names
EMPTY_PARAMETERS: JSONObject = {"type": "object", "properties": {}}
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _refuse(param: str, message: str, code: str = "invalid_field") -> NoReturn:
    raise B.BoundError(param, message, code)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, eq=False)
class Tool:
    """A function the model may call. `parameters` is the JSON Schema of its arguments object."""

    name: str
    description: str = ""
    parameters: JSONObject = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def spec(self) -> JSONObject:
        """The OpenAI shape, which chat templates render."""
        fn: JSONObject = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made. `arguments` is the JSON object's text, as the model wrote it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def args(self) -> JSONObject:
        value = json.loads(self.arguments)
        return value if isinstance(value, dict) else {}

    def spec(self) -> JSONObject:
        """The OpenAI shape of a reply's call."""
        fn: JSONObject = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """Whether a reply calls: `auto` (the model chooses), `none`, `required`, or `named` (that one)."""

    mode: str
    name: str = ""

    @classmethod
    def named(cls, name: str) -> ToolChoice:
        return cls("named", name)


AUTO, NONE, REQUIRED = ToolChoice("auto"), ToolChoice("none"), ToolChoice("required")


@dataclass(frozen=True)
class CallSyntax:
    """How a model writes its calls: `open`, then `{"name": "...", "<arguments>": {...}}`, then `close`."""

    name: str
    open: str
    close: str
    arguments: str  # the key of the arguments object
    separator: str  # between two calls; empty where a reply holds one call

    @property
    def lead(self) -> str:
        """How every call starts: a reply that starts otherwise is text."""
        return self.open or '{"'

    def head(self, name: str) -> str:
        return f'{{"name": "{name}", "{self.arguments}": '

    def write(self, call: ToolCall) -> str:
        return self.open + self.head(call.name) + call.arguments + "}" + self.close


HERMES = CallSyntax("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3 = CallSyntax("llama3", "", "", "parameters", "")
MAX_PARALLEL_CALLS = 4  # calls in one reply when the client allows several


# -- checking a client's functions ---------------------------------------------------------------------
def check_tool(name: object, description: object, parameters: object, param: str, where: str) -> Tool:
    """A function checked against the bounds table and llguidance; raises BoundError naming `param`."""
    most = B.SIZES["tool_name_chars"]
    if not isinstance(name, str) or not NAME.fullmatch(name) or len(name) > most:
        shown = json.dumps(name)[:80] if isinstance(name, str) else "not a string"
        _refuse(param, f"{where}.name ({shown}) must be 1..{most} of the characters a-z, A-Z, 0-9, _ and -")
    if description is None:
        description = ""
    if not isinstance(description, str):
        _refuse(param, f"{where}.description must be a string")
    if len(description) > B.SIZES["tool_description_chars"]:
        limit = B.SIZES["tool_description_chars"]
        _refuse(param, f"{where}.description has more than {limit} characters")
    schema = dict(EMPTY_PARAMETERS) if parameters is None else parameters
    if not isinstance(schema, dict):
        _refuse(param, f"{where}.parameters must be a JSON Schema object")
    _check_schema(schema, param, f"{where}.parameters")
    return Tool(name, description, schema)


def _check_schema(schema: JSONObject, param: str, where: str) -> None:
    """Size, depth, an object at the top, local non-recursive $refs, and llguidance compiles it."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text) > B.SIZES["tool_schema_chars"]:
        limit = B.SIZES["tool_schema_chars"]
        _refuse(param, f"{where} has {len(text)} characters of JSON, the limit is {limit}")
    if _depth(schema) > B.SIZES["schema_depth"]:
        _refuse(param, f"{where} nests deeper than {B.SIZES['schema_depth']} levels")
    if schema.get("type", "object") != "object":
        _refuse(param, f"{where} must describe an object (its 'type' is {json.dumps(schema.get('type'))})")
    if "x-guidance" in text:
        _refuse(param, f"{where}: 'x-guidance' is not accepted")
    _check_refs(schema, param, where)
    try:
        OutputFormat.json_schema(schema).check()
    except OutputFormatError as exc:
        _refuse(param, f"{where}: {exc}", "bad_output_format")


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _refs(value: object, at: str) -> list[tuple[str, str]]:
    """(where, target) of every $ref under `value`, which sits at pointer `at`."""
    found: list[tuple[str, str]] = []
    if isinstance(value, dict):
        ref = value.get("$ref")
        if "$ref" in value:
            found.append((at, ref if isinstance(ref, str) else ""))
        for key, item in value.items():
            found += _refs(item, f"{at}/{str(key).replace('~', '~0').replace('/', '~1')}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _refs(item, f"{at}/{i}")
    return found


def _resolve(schema: JSONObject, pointer: str) -> object:
    """The value at a local JSON pointer ("#/$defs/a"), or a KeyError."""
    value: object = schema
    for part in pointer[1:].split("/")[1:] if pointer != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            raise KeyError(pointer)
    return value


def _inside(pointer: str, at: str) -> bool:
    return at == pointer or at.startswith(pointer.rstrip("/") + "/")


def _check_refs(schema: JSONObject, param: str, where: str) -> None:
    """Every $ref is a local pointer that resolves, and none leads back into itself."""
    done: set[str] = set()

    def visit(pointer: str, stack: list[str]) -> None:
        if pointer in done:
            return
        for at, target in _refs(_resolve(schema, pointer), pointer):
            if not target.startswith("#"):
                _refuse(param, f"{where}: $ref {json.dumps(target)[:80]} is not a local '#/...' pointer")
            try:
                _resolve(schema, target)
            except KeyError:
                _refuse(param, f"{where}: $ref {json.dumps(target)[:80]} points at nothing")
            if target in stack or _inside(target, at):
                _refuse(param, f"{where}: $ref {json.dumps(target)[:80]} is recursive")
            visit(target, [*stack, target])
        done.add(pointer)

    visit("#", ["#"])


def read_tools(value: object, param: str = "tools") -> list[Tool]:
    """A client's `tools` list (OpenAI's shape) as Tools; raises BoundError naming `param`."""
    if value is None:
        return []
    shape = '[{"type": "function", "function": {"name", "description", "parameters"}}]'
    if not isinstance(value, list):
        _refuse(param, f"'{param}' must be a list {shape}")
    if len(value) > B.SIZES["tools"]:
        limit = B.SIZES["tools"]
        _refuse(param, f"'{param}' has {len(value)} functions, the limit is {limit}")
    tools: list[Tool] = []
    total = 0
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        fn = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(fn, dict):
            _refuse(param, f"{where} must be {shape[1:-1]}")
        extra = sorted(set(fn) - FUNCTION_KEYS)
        if extra:
            _refuse(param, f"{where}.function.{extra[0]} is not supported", "unsupported")
        tool = check_tool(
            fn.get("name"), fn.get("description"), fn.get("parameters"), param, where + ".function"
        )
        if any(t.name == tool.name for t in tools):
            _refuse(param, f"{where}.function.name {tool.name!r} is given twice")
        total += len(json.dumps(tool.spec(), separators=(",", ":"), ensure_ascii=False))
        if total > B.SIZES["tools_chars"]:
            limit = B.SIZES["tools_chars"]
            _refuse(param, f"'{param}' has more than {limit} characters of JSON")
        tools.append(tool)
    return tools


def read_choice(value: object, tools: Sequence[Tool], param: str = "tool_choice") -> ToolChoice:
    """A client's `tool_choice`; absent is `auto` with tools, `none` without. Raises BoundError."""
    if value is None:
        return AUTO if tools else NONE
    if value in ("auto", "none", "required"):
        if value != "none" and not tools:
            _refuse(param, f"'{param}' {value!r} needs 'tools'")
        return ToolChoice(str(value))
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str):
        if not any(t.name == name for t in tools):
            _refuse(param, f"'{param}' names {json.dumps(name)[:80]}, which is not one of 'tools'")
        return ToolChoice.named(name)
    shape = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
    _refuse(param, f"'{param}' must be {shape}")


# -- the grammar -----------------------------------------------------------------------------------------
def _lark_regex(text: str) -> str:
    """`text` as a literal inside a lark /regex/ (Rust regex syntax)."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def tool_call_format(
    tools: Sequence[Tool], choice: ToolChoice, syntax: CallSyntax = HERMES, max_calls: int = 1
) -> OutputFormat:
    """The format of a reply: calls only (`required`, `named`), text or calls (`auto`), free (`none`).
    Each call's arguments follow its function's schema, written as compact JSON."""
    offered = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    if choice.mode == "none" or not offered:
        return TEXT
    rules = []
    for i, tool in enumerate(offered):
        schema = json.dumps({**tool.parameters, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))
        head = json.dumps(syntax.open + syntax.head(tool.name))
        rules.append(f"call_{i}: {head} %json {schema} {json.dumps('}' + syntax.close)}")
    calls = max_calls if syntax.separator else 1
    lines = [
        "call: " + " | ".join(f"call_{i}" for i in range(len(offered))),
        "calls: " + " | ".join(" SEP ".join(["call"] * n) for n in range(1, calls + 1)),
        *rules,
    ]
    if calls > 1:
        lines.append(f"SEP: {json.dumps(syntax.separator)}")
    if choice.mode == "auto":
        # text never holds a call's opening: a call the model starts is always constrained (a syntax
        # without one, bare JSON, keeps only text that does not start like a call)
        anywhere = ".*" if syntax.open else ""
        lines[:0] = [
            "start: TEXT | calls",
            f"TEXT: /(?s:.*)/ & ~/(?s:{anywhere}{_lark_regex(syntax.lead)}.*)/",
        ]
    else:
        lines.insert(0, "start: calls")
    return OutputFormat.lark("\n".join(lines))


# -- reading calls back ----------------------------------------------------------------------------------
def _head_pattern(syntax: CallSyntax) -> re.Pattern[str]:
    name = NAME.pattern
    return re.compile(
        re.escape(syntax.open) + re.escape('{"name": "') + f"({name})" + re.escape(syntax.head("")[10:])
    )


def parse_tool_calls(text: str, tools: Sequence[Tool], syntax: CallSyntax = HERMES) -> list[ToolCall]:
    """The complete calls a reply starts with, as the grammar writes them; [] when it is text."""
    names = {t.name for t in tools}
    pattern, decoder = _head_pattern(syntax), json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while at < len(text):
        if calls:
            if not text.startswith(syntax.separator, at) or not syntax.separator:
                break
            at += len(syntax.separator)
        m = pattern.match(text, at)
        if m is None or m.group(1) not in names:
            break
        try:
            args, end = decoder.raw_decode(text, m.end())
        except ValueError:
            break
        closing = "}" + syntax.close
        if not isinstance(args, dict) or not text.startswith(closing, end):
            break
        calls.append(ToolCall(m.group(1), text[m.end() : end]))
        at = end + len(closing)
    return calls


@dataclass
class CallPiece:
    """A piece of a streamed call: its first names it (`id`, `name`); the rest add `arguments`."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class CallReader:
    """A streamed reply read as it comes: text passes through; calls come out in pieces. It decides
    once the reply's start shows whether it opens a call."""

    def __init__(self, syntax: CallSyntax = HERMES):
        self.syntax = syntax
        self.mode = ""  # "" undecided, "text" or "calls"
        self.buffer = ""
        self.at = 0  # what of the buffer is read
        self.in_call = False  # between a call's head and its end
        self.index = -1
        self._head = _head_pattern(syntax)
        self._end = "}" + syntax.close

    def feed(self, text: str) -> tuple[str, list[CallPiece]]:
        """(text, call pieces) that `text` completes."""
        self.buffer += text
        if not self.mode:
            if self.buffer.startswith(self.syntax.lead):
                self.mode = "calls"
            elif self.syntax.lead.startswith(self.buffer):
                return "", []
            else:
                self.mode = "text"
        if self.mode == "text":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._calls(final=False)

    def end(self) -> tuple[str, list[CallPiece]]:
        """What is left once the reply has ended."""
        if self.mode != "calls":
            out, self.buffer = self.buffer, ""
            return out, []
        return "", self._calls(final=True)

    def _calls(self, final: bool) -> list[CallPiece]:
        pieces: list[CallPiece] = []
        while True:
            if not self.in_call:
                start = self.at + (len(self.syntax.separator) if self.index >= 0 else 0)
                m = self._head.match(self.buffer, start)
                if m is None or (self.index >= 0 and not self.syntax.separator):
                    return pieces
                self.index += 1
                pieces.append(CallPiece(self.index, new_call_id(), m.group(1)))
                self.at, self.in_call = m.end(), True
            k = self.buffer.find(self._end, self.at) if self.syntax.close else -1
            if k < 0:
                # the tail may be the start of the call's end: held until the next text or the end
                if self.syntax.close:
                    hold = 0 if final else len(self._end) - 1
                else:  # no closing text: the reply's last "}" ends the call
                    hold = 1 if not final or self.buffer.endswith("}") else 0
                upto = max(self.at, len(self.buffer) - hold)
                if upto > self.at:
                    pieces.append(CallPiece(self.index, arguments=self.buffer[self.at : upto]))
                    self.at = upto
                return pieces
            if k > self.at:
                pieces.append(CallPiece(self.index, arguments=self.buffer[self.at : k]))
            self.at, self.in_call = k + len(self._end), False


# -- the prompt ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatMessage:
    """A chat message with what tool calling adds: an assistant's calls, a tool result's call id."""

    role: str  # system, user, assistant or tool
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


PROBE = Tool("qzx_probe_function", "", {"type": "object", "properties": {}})
_SYNTAXES: dict[str, CallSyntax | None] = {}  # chat template text -> its call syntax


def template_syntax(tokenizer: Tokenizer) -> CallSyntax | None:
    """The call syntax of a chat template that renders tools; None where it does not (or in a syntax
    this module does not read), so the fallback describes them."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if template not in _SYNTAXES:
        messages = [{"role": "user", "content": "x"}]
        try:
            shown = tokenizer.apply_chat_template(messages, tools=[PROBE.spec()], tokenize=False)
        except Exception:  # a template that fails on tools takes none
            shown = ""
        syntax = None
        if isinstance(shown, str) and PROBE.name in shown:
            syntax = HERMES if "<tool_call>" in template else LLAMA3 if '"parameters"' in template else None
        _SYNTAXES[template] = syntax
    return _SYNTAXES[template]


def fallback_block(tools: Sequence[Tool], syntax: CallSyntax = HERMES) -> str:
    """The system message's part that offers `tools` to a model whose template takes none."""
    listed = "\n".join(
        json.dumps(
            {"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False
        )
        for t in tools
    )
    example = syntax.open + syntax.head("<function name>") + "<arguments as a JSON object>}" + syntax.close
    return (
        f"You can call these functions, each given as JSON:\n{listed}\n\n"
        f"To call a function, reply with this and nothing else:\n{example}\n"
        "A function's result comes back inside <tool_response></tool_response>."
    )


def control_strings(tokenizer: Tokenizer) -> list[str]:
    """The text of the tokenizer's special and added tokens: none may come from a client's functions."""
    found = {tokenizer.decode([i]) for i in tokenizer.all_special_ids}
    added = getattr(tokenizer, "get_added_vocab", None)
    vocab = added() if callable(added) else {}
    found.update(str(key) for key in vocab)
    return sorted(s for s in found if s.strip())


def check_control_text(tokenizer: Tokenizer, tools: Sequence[Tool], messages: Sequence[ChatMessage]) -> None:
    """Refuse a function or call whose text holds a control token: a template writes it as is."""
    controls = control_strings(tokenizer)
    texts = [("tools", f"tools[{i}]", json.dumps(t.spec(), ensure_ascii=False)) for i, t in enumerate(tools)]
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls):
            texts.append(("messages", f"messages[{i}].tool_calls[{j}]", call.name + call.arguments + call.id))
    for param, where, text in texts:
        for control in controls:
            if control in text:
                _refuse(param, f"{where} contains {control!r}, a control token of this model")


def _stand_in(i: int) -> str:
    """Content i's place while the template renders: letters only, one length, none inside another."""
    return "QzxToolText" + "".join(chr(ord("a") + i // 26**k % 26) for k in (3, 2, 1, 0)) + "Qzx"


def _template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, object]]:
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    out: list[dict[str, object]] = []
    for m in messages:
        d: dict[str, object] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args()}}
                for c in m.tool_calls
            ]
        if m.role == "tool":
            d["tool_call_id"], d["name"] = m.tool_call_id, names.get(m.tool_call_id, "")
        out.append(d)
    return out


def _fallback_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool]) -> list[dict[str, object]]:
    """Calls and results as text in the fallback's syntax; the functions in the system message."""
    out: list[dict[str, object]] = []
    for m in messages:
        if m.role == "tool":
            result = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] = f"{out[-1]['content']}\n{result}"
            else:
                out.append({"role": "user", "content": result, "tool_result": True})
            continue
        calls = "\n".join(HERMES.write(c) for c in m.tool_calls)
        out.append({"role": m.role, "content": "\n".join(s for s in (m.content, calls) if s)})
    if tools:
        block = fallback_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": d["role"], "content": d["content"]} for d in out]


def _segments(
    tokenizer: Tokenizer, messages: list[dict[str, object]], tools: Sequence[Tool]
) -> list[tuple[str, bool]]:
    """The rendering as (text, is_content) pieces: contents are data, never template. A content the
    template leaves out is left out."""
    marks = {i: _stand_in(i) for i, m in enumerate(messages) if m.get("content")}
    shown = [{**m, "content": marks.get(i, "")} for i, m in enumerate(messages)]
    options: dict[str, object] = {"tools": [t.spec() for t in tools]} if tools else {}
    require_chat_template(tokenizer)
    try:
        rendered = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **options)
    except Exception as exc:  # jinja's raise_exception, or a template that cannot take these messages
        _refuse("messages", f"the model's chat template cannot render these messages: {exc}"[:300])
    segments: list[tuple[str, bool]] = []
    at = 0
    for i, mark in marks.items():
        k = rendered.find(mark, at)
        if rendered.count(mark) > 1:
            _refuse("messages", "the model's chat template renders a message twice")
        if k < 0:
            continue
        segments += [(rendered[at:k], False), (str(messages[i]["content"]), True)]
        at = k + len(mark)
    segments.append((rendered[at:], False))
    return segments


def encode_tool_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool],
    system_prompt: str = "",
) -> tuple[ChatPrompt, CallSyntax]:
    """The prompt of a chat with tools (none where `tool_choice` is `none`), and the syntax its calls
    take. `system_prompt` goes first where the messages bring none. Raises BoundError."""
    check_control_text(tokenizer, tools, messages)
    if system_prompt and not (messages and messages[0].role == "system"):
        messages = [ChatMessage("system", system_prompt), *messages]
    syntax = template_syntax(tokenizer)
    if syntax is not None:
        segments = _segments(tokenizer, _template_messages(messages), tools)
    else:
        syntax = HERMES
        segments = _segments(tokenizer, _fallback_messages(messages, tools), [])
    ids: list[int] = []
    for text, content in segments:
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=content)
    return ChatPrompt("".join(text for text, _ in segments), ids, 0), syntax
