"""The request bodies' parts that need no server (serve/protocol.py)."""
from phaseflip.serve.protocol import ChatMessage


def test_a_chat_message_reaches_the_template_with_its_parts_joined_and_its_name():
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
                        name="ada")
    assert parts.as_template_message() == {"role": "user", "content": "first\nsecond", "name": "ada"}
    assert ChatMessage(role="assistant").as_template_message() == {"role": "assistant", "content": ""}
