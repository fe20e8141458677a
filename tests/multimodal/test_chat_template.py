"""Chat templates that render ``{"type": "image"}`` parts (the processors' templates of llava-hf and
SmolVLM checkpoints, kept in ``chat_template.json``): the server hands them content parts, each image
part becomes exactly one image token where the template puts it, and a template that loses an image
is a 400."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata import Engine
from kvstrata.engine.loader import load_model
from kvstrata.multimodal.assemble import assemble
from kvstrata.multimodal.chat import takes_image_parts
from kvstrata.server.engine_client import EngineClient
from kvstrata.server.errors import APIError
from kvstrata.server.protocol import ChatMessage
from kvstrata.server.validation import chat_prompt

from .tiny_vlm import data_url, make_image

# Shaped like llava-hf/llava-1.5-7b-hf's chat_template.json: every image of a message first, then its text.
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', "
    "'text') %}{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Shaped like HuggingFaceTB/SmolVLM-256M-Instruct's: parts in their order.
SMOLVLM = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Mentions image parts but never renders them.
LOSES_IMAGES = (
    "{# 'image' parts are dropped #}{% for m in messages %}{{ m['content'][-1]['text'] }}{% endfor %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = assemble(Path(tmp_path_factory.mktemp("vlm-template")))
    # As llava-hf publishes it: the template only in the processor's chat_template.json.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def client_with(model_dir: Path, template: str) -> tuple[Engine, EngineClient]:
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    engine = Engine(load_model(model_dir), kv_plan="off", max_total_tokens=512, max_running_requests=2)
    return engine, EngineClient(engine)


def messages(image_url: str) -> list[ChatMessage]:
    return [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(
            role="user",
            content=[
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": image_url}},
            ],
        ),
    ]


@pytest.mark.parametrize(
    ("template", "expect"),
    [
        (LLAVA, "Be brief. USER: <image>\nWhat is this? ASSISTANT:"),
        (
            SMOLVLM,
            "<|im_start|>System: Be brief.<end_of_utterance>\n"
            "User: What is this?<image><end_of_utterance>\nAssistant:",
        ),
    ],
    ids=["llava", "smolvlm"],
)
def test_image_parts_reach_the_processor_template(model_dir: Path, template: str, expect: str):
    engine, client = client_with(model_dir, template)
    with engine:
        assert engine.tokenizer.chat_template == template and client.template_takes_image_parts()
        ids, images = chat_prompt(client, messages(data_url(make_image(3))))
        assert ids == client.encode(expect, add_special_tokens=False)
        assert ids.count(client.image_token_id()) == 1 and len(images) == 1
        out = engine.generate(input_ids=ids, image_data=images, sampling_params={"max_new_tokens": 2})
        assert out["meta_info"]["prompt_tokens"] == len(ids) + client.image_extra_tokens(images)


def test_a_template_that_loses_the_image_is_refused(model_dir: Path):
    engine, client = client_with(model_dir, LOSES_IMAGES)
    with engine:
        with pytest.raises(APIError) as err:
            chat_prompt(client, messages(data_url(make_image(4))))
        assert err.value.status == 400 and "placed 0 image tokens for 1 images" in str(err.value)


def test_which_templates_take_image_parts():
    assert takes_image_parts(LLAVA) and takes_image_parts(SMOLVLM)
    assert takes_image_parts({"default": SMOLVLM, "tool_use": "x"})
    smollm2 = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert not takes_image_parts(smollm2) and not takes_image_parts(None)
