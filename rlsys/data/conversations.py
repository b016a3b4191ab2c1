"""Conversational prompts: a row whose prompt is a list of chat messages, as TRL's conversational
datasets and OpenAI's chat API write them, instead of a string.

    {"prompt": [{"role": "system", "content": "Answer with one word."},
                {"role": "user", "content": [{"type": "image", "image": "shapes/0.png"},
                                             {"type": "text", "text": "What colour is the square?"}]}],
     "label": "red"}

A message is `role` (system, user, assistant or tool) and `content`: a string, or a list of parts,
each `{"type": "text", "text": ...}` or `{"type": "image", "image": ...}` (also `image_url`, as
`{"url": ...}` or a string, OpenAI's form) where an image is what rlsys/multimodal/images.py reads (a
path relative to the data file, bytes, base64, a data: URI, a datasets Image). The last message is
the one answered: a user (or tool) turn. The run renders the messages with the tokenizer's chat
template, each image part where it stands; the reward's `prompt` is the text of the last user turn.
"""

from __future__ import annotations

from pathlib import Path

from rlsys.multimodal.images import ImageError, read_images

ROLES = ("system", "user", "assistant", "tool")


class ConversationError(ValueError):
    """What is wrong with a conversational prompt, and where in it (`[1].content[0].image: ...`)."""


def read_conversation(value: list, base_dir: Path | None) -> tuple[tuple[dict, ...], tuple[bytes, ...], str]:
    """(messages, images, prompt text): the messages with each image part as {"type": "image"}, the
    images' bytes in the order their parts stand, and the last user turn's text."""
    if not value:
        raise ConversationError(": an empty list of messages")
    messages, images = [], []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConversationError(f"[{index}]: a message must be an object with a 'role' and a 'content', "
                                    f"got {_shown(message)}")
        if message["role"] not in ROLES:
            raise ConversationError(f"[{index}].role: {message['role']!r} is not one of {', '.join(ROLES)}")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise ConversationError(f"[{index}].content: a string or a non-empty list of parts, got {_shown(content)}")
        parts = [_part(part, f"[{index}].content[{number}]", base_dir, images) for number, part in enumerate(content)]
        messages.append({"role": message["role"], "content": parts})
    if messages[-1]["role"] not in ("user", "tool"):
        raise ConversationError(f"[{len(messages) - 1}].role: the last message is the one answered, a user (or "
                                f"tool) turn, not {messages[-1]['role']!r}")
    return tuple(messages), tuple(images), _last_user_text(messages)


def _part(part, where: str, base_dir: Path | None, images: list[bytes]) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in ("image", "image_url"):
        source = part.get(kind)
        if kind == "image_url" and isinstance(source, dict):
            source = source.get("url")
        if source is None or isinstance(source, list | tuple):
            raise ConversationError(f"{where}: an {kind} part holds one image in its {kind!r} field "
                                    f"(several images: one part each), got {_shown(source)}")
        try:
            images.extend(read_images(source, base_dir))
        except ImageError as error:
            raise ConversationError(f"{where}.{kind}{error}") from None
        return {"type": "image"}
    raise ConversationError(f"{where}: a part is {{'type': 'text', 'text': ...}} or {{'type': 'image', 'image': ...}}, "
                            f"got {_shown(part)}")


def _last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message["role"] == "user":
            content = message["content"]
            return content if isinstance(content, str) else "\n".join(
                part["text"] for part in content if part["type"] == "text")
    return ""


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
