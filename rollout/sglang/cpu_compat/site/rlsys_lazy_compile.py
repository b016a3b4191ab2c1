"""`torch.compile` of a function initialises TorchDynamo on first call instead of at once (CPU
servers only).

Several SGLang modules wrap functions in `torch.compile` when they are imported (the DeepGEMM MoE
runner, penalty and attention helpers). torch compiles lazily, on the first call, but
`torch.compile` itself imports and sets up TorchDynamo: ~1.2 s of a CPU engine's ~9.5 s start,
on the critical path of every run, for kernels a CPU server of a dense model never calls. Here
`torch.compile(fn, ...)` returns a wrapper that calls the real `torch.compile(fn, ...)` on its
first call and the compiled function from then on: what runs, and when it compiles, is unchanged.
Modules go to the real `torch.compile` as given (it returns a module, not a function).

Installed by `sitecustomize` (`defer_dynamo_setup`) when torch is imported and no GPU is present.
"""

from __future__ import annotations

import functools

import torch


def defer_dynamo_setup(real_compile):
    def compile(model=None, **options):
        if model is None:  # @torch.compile(mode=...): options first, the function next
            return lambda function: compile(function, **options)
        if isinstance(model, staticmethod):  # @torch.compile over @staticmethod in a class body
            return staticmethod(compile(model.__func__, **options))
        if isinstance(model, torch.nn.Module) or not callable(model):
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile
