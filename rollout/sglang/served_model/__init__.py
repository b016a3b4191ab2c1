"""The model class an rlsys engine serves, as SGLang's model registry reads a model package.

At start-up SGLang imports every module of `sglang.srt.models` (~150, ~0.9 s of a CPU engine's
start) to map architecture names to classes. Given `SGLANG_EXTERNAL_MODEL_PACKAGE`, it imports
that package's modules instead and resolves an architecture found there without importing the
rest (sglang/srt/models/registry.py, `resolve_model_cls`). The launcher points it here and names
the one class in `RLSYS_SGLANG_MODEL_CLASS` (`rlsys.rollout.sglang.server.served_model_class`); the
`entry` module imports that class as its `EntryClass`.
"""
