"""Tokenizer and chat template, both taken from the model itself.

Safety rule: text a user sends is always encoded as plain text. A message containing the string
`<|im_end|>` must not become the control token, or a user could close their own turn and write the
assistant's. Only the chat template inserts control tokens. We render the template with a unique
placeholder for each message's content, then encode the template's own text with special-token
matching and the user's text with it switched off.

One `tokenizers` object serves both, with special-token matching off: the template's text is split at the
special tokens' strings here (what the library's added vocabulary does, for tokens matched exactly, as
GGUF control tokens and most tokenizer.json ones are). A second copy with matching on held 55 MB for a
128k vocabulary (in the server and again in its request-preparation helper); it is kept only for a
tokenizer.json whose special tokens strip spaces or match single words.
"""

from __future__ import annotations

import re
import secrets
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:  # a type only: the request-preparation helper unpickles a Tokenizer without torch
    from .loader import LoadedModel

# llama.cpp's pre-tokenizer names for byte-level BPE vocabularies, mapped to their split regexes.
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

CONTROL_TOKEN_TYPES = {3, 4}  # llama.cpp token types: 3 control, 4 user-defined


def _split(regex: str) -> Any:
    from tokenizers import Regex

    return pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)


def _tokenizer_from_gguf(fields: dict[str, Any]) -> HFTokenizer:
    if fields.get("model") != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {fields.get('model')!r} is not supported; byte-level BPE ('gpt2') is. "
            "Point `model` at the Hugging Face folder of this model instead (it carries tokenizer.json).")
    tokens: list[str] = list(fields["tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = fields.get("pre") or "gpt2"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":
        splits = [pre_tokenizers.Digits(individual_digits=True), _split(_GPT2_REGEX)]
    elif pre in ("llama-bpe", "llama3"):
        splits = [_split(_LLAMA3_REGEX)]
    elif pre == "qwen2":
        splits = [_split(_QWEN2_REGEX)]
    else:
        splits = [_split(_GPT2_REGEX)]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    types = list(fields.get("token_type") or [])
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types) if int(t) in CONTROL_TOKEN_TYPES]
    tok.add_special_tokens(specials)
    return tok


class Tokenizer:
    """Encode, decode and chat-template rendering. Pure and thread-safe after construction."""

    def __init__(self, model: LoadedModel):
        if model.tokenizer_json:
            self._tok = HFTokenizer.from_file(model.tokenizer_json)
        else:
            self._tok = _tokenizer_from_gguf(model.gguf_tokenizer)
        self._tok.encode_special_tokens = True  # user text: special-token strings stay plain text
        self._specials, self._special_ids = _special_splitter(self._tok)
        # Only where the split above cannot stand in for the library's matching: a copy that matches them.
        self._trusted = None if self._specials is not None else self._clone(encode_special_tokens=False)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = model.bos_token_id
        self.eos_token_ids = list(model.eos_token_ids)
        self.bos_token = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        self.eos_token = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        self._template_source = model.chat_template
        self._template = _compile_template(model.chat_template)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a compiled jinja template is not), so a helper process can tokenize long prompts."""
        state = dict(self.__dict__)
        state["_tok"] = self._tok.to_str()
        state["_trusted"] = None if self._trusted is None else self._trusted.to_str()
        state["_template"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tok = HFTokenizer.from_str(state["_tok"])
        self._tok.encode_special_tokens = True
        if state["_trusted"] is not None:
            self._trusted = HFTokenizer.from_str(state["_trusted"])
        self._template = _compile_template(self._template_source)

    def _clone(self, encode_special_tokens: bool) -> HFTokenizer:
        copy = HFTokenizer.from_str(self._tok.to_str())
        copy.encode_special_tokens = encode_special_tokens
        return copy

    def to_json(self) -> str:
        """The Hugging Face `tokenizers` JSON of the model's tokenizer (the grammar engine builds its own from it)."""
        return self._tok.to_str()

    def token_pieces(self) -> dict[int, str]:
        """Each token id's piece as the vocabulary spells it, special tokens included. For byte-level BPE
        (GPT-2's byte-to-character map) a piece gives back the token's exact bytes, which decoding one
        token alone cannot when it holds part of a UTF-8 character (logprobs report those bytes)."""
        pieces = {}
        for i in range(self._tok.get_vocab_size()):
            piece = self._tok.id_to_token(i)
            if piece is not None:
                pieces[i] = piece
        return pieces

    # -- encoding --------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain text, never control tokens (for user-supplied text)."""
        if not text:
            return []
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_trusted(self, text: str) -> list[int]:
        """The template's own text: its special-token strings become those tokens."""
        if not text:
            return []
        if self._specials is None:
            assert self._trusted is not None
            return self._trusted.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        start = 0
        for m in self._specials.finditer(text):
            ids += self.encode(text[start:m.start()])
            ids.append(self._special_ids[m.group()])
            start = m.end()
        return ids + self.encode(text[start:])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """The conversation's prompt ids. `continue_final_message` (vLLM's and transformers' name): the last
        message (a partial assistant answer) is left open, so generation continues its text; the
        template's end-of-turn after it is cut off (and no generation prompt is added)."""
        if continue_final_message:
            add_generation_prompt = False
        if self._template is None:
            # No template in the model: a plain "role: content" transcript.
            text_parts: list[tuple[str, bool]] = []
            for m in messages:
                text_parts += [(f"{m['role']}: ", True), (str(m.get("content") or ""), False), ("\n", True)]
            if continue_final_message and text_parts:
                text_parts.pop()
            if add_generation_prompt:
                text_parts.append(("assistant: ", True))
            return [t for part, trusted in text_parts
                    for t in (self._encode_trusted(part) if trusted else self.encode(part))]

        marker = f"\x00{secrets.token_hex(8)}:"
        placeholders: dict[str, str] = {}
        safe_messages = []
        for i, m in enumerate(messages):
            key = f"{marker}{i}\x00"
            placeholders[key] = str(m.get("content") or "")
            safe_messages.append({**m, "content": key})
        rendered = self._template.render(
            messages=safe_messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)
        if continue_final_message and safe_messages:
            last = str(safe_messages[-1]["content"])
            cut = rendered.rfind(last)
            if cut < 0:
                raise ValueError("the chat template does not render the final message's content: it cannot be "
                                 "continued")
            rendered = rendered[:cut + len(last)]
        ids: list[int] = []
        start = 0  # positions into `rendered`, never slices of the rest: linear in the conversation's size
        while start < len(rendered):
            pos = rendered.find(marker, start)
            if pos < 0:
                ids += self._encode_trusted(rendered[start:])
                break
            end = rendered.index("\x00", pos + len(marker)) + 1
            ids += self._encode_trusted(rendered[start:pos])
            ids += self.encode(placeholders[rendered[pos:end]])
            start = end
        return ids


def _special_splitter(tok: HFTokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A pattern of the special tokens' strings, longest first at each position (the library matches added
    tokens leftmost-longest), and their ids; (None, {}) when a special token strips spaces around it, matches
    single words only or is normalized first: then only the library's own matching gives its tokens."""
    added = tok.get_added_tokens_decoder()
    specials = {t.content: i for i, t in added.items() if t.special}
    if any(t.special and (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values()):
        return None, {}
    if not specials:
        return re.compile(r"(?!)"), {}  # matches nothing
    return re.compile("|".join(re.escape(c) for c in sorted(specials, key=len, reverse=True))), specials


def _compile_template(source: str | None) -> jinja2.Template | None:
    if not source:
        return None
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals["raise_exception"] = _raise_template_error
    return env.from_string(source)


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without broken UTF-8 or lost spaces.

    Decodes a short window of recent tokens twice (with and without the newest ones) and emits the
    difference, holding back while the tail is an incomplete UTF-8 sequence (U+FFFD), as vLLM does.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]):
        self._tok = tokenizer
        self.ids = list(context_ids)
        self._read = len(self.ids)
        self._prefix = max(0, self._read - 6)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self._tok.decode(self.ids[self._prefix:self._read])
        full_text = self._tok.decode(self.ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""
