"""Registering the custom ops the CPU step calls per layer straight with torch's dispatcher.

Owns: `define_op`. torch.library.custom_op wraps an op in Python layers (autograd, default filling,
redispatch), a cost per call that a batch-1 token pays at every layer's attention call (several percent
of the token).
An op defined from its schema with one CompositeExplicitAutograd kernel goes through the C++
dispatcher to its Python body alone. These ops never take gradients (inference only), and
torch.compile treats them as it treats custom_op's: one opaque call (functionalised where the schema
says an argument is mutated), with the fake kernel for tracing.
"""
from __future__ import annotations

from typing import Callable

import torch

_libraries: list = []  # kept alive: a Library's registrations end with it


def define_op(schema: str, body: Callable, fake: Callable):
    """Define `phaseflip::<schema>` with body as its kernel on every backend and fake for tracing;
    returns the op (torch.ops.phaseflip.<name>)."""
    name = schema.split("(", 1)[0]
    lib = torch.library.Library("phaseflip", "FRAGMENT")
    lib.define(schema)
    lib.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"phaseflip::{name}", fake, lib=lib)
    _libraries.append(lib)
    return getattr(torch.ops.phaseflip, name)
