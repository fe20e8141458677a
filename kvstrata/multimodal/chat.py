"""Chat templates of vision-language checkpoints: which ones render image content parts, and where a
processor keeps its template.

The processors of ``llava-hf/*`` and ``HuggingFaceTB/SmolVLM-*`` ship a chat template that reads a
message's ``content`` as a list of parts and writes the image token for each ``{"type": "image"}``
part itself (often in ``chat_template.json``, which the tokenizer does not read). Text-only templates
(SmolLM2, Llama) take a string, with the image token already in the text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# A template that compares a part's type with "image" ('equalto', 'image' or == 'image').
_IMAGE_PART = re.compile(r"""['"]image['"]""")


def takes_image_parts(template: str | dict[str, str] | None) -> bool:
    """Whether ``template`` (a tokenizer's ``chat_template``: a string, or named templates of which
    ``default`` is used) renders ``{"type": "image"}`` content parts itself."""
    if isinstance(template, dict):
        template = template.get("default")
    return bool(template) and _IMAGE_PART.search(str(template)) is not None


def adopt_processor_template(tokenizer: Any, model_dir: Path) -> None:
    """Give ``tokenizer`` the processor's chat template (``chat_template.json``) when it has none."""
    path = model_dir / "chat_template.json"
    if tokenizer is None or getattr(tokenizer, "chat_template", None) or not path.is_file():
        return
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, str) and template:
        tokenizer.chat_template = template
