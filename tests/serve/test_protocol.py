"""The request bodies' parts that need no server (serve/protocol.py) and the tokenizer's chat options
(engine/checkpoint/tokenizer.py) they reach."""
import pytest

from phaseflip.engine.checkpoint.tokenizer import load_tokenizer
from phaseflip.serve.protocol import ChatMessage


def test_a_chat_message_reaches_the_template_with_its_parts_joined_and_its_name(default_model_dir):
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
                        name="ada")
    message = parts.as_template_message()
    assert message["name"] == "ada"
    tok = load_tokenizer(default_model_dir)
    assert tok.apply_chat_template([message]) == tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert ChatMessage(role="assistant").as_template_message() == {"role": "assistant", "content": ""}


def test_the_tokenizer_answers_hf_calls_and_vllm_chat_options(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    assert tok("hello")["input_ids"] == tok.encode("hello") and len(tok) == tok.vocab_size
    assert tok.batch_decode([tok.encode("hello")]) == ["hello"]
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == tok.eos_token
    text = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(chat[:1], tokenize=True) == tok.encode(text, add_special_tokens=False)
    opened = tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True)
    closed = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert opened.endswith("The colour is") and closed.startswith(opened) and len(closed) > len(opened)
    with pytest.raises(ValueError, match="cannot also add a generation prompt"):
        tok.apply_chat_template(chat, continue_final_message=True)
    with pytest.raises(ValueError, match=r"\['image_url'\] are not served"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
