"""Adapters over the vLLM internals that an extraction engine drives by hand, one module per concern.

One set of adapters, used twice: by the patch units that make speculators 0.3.0's generator work (at its call
sites) and by eagle_compat's own generator. Every branch is feature-detected (see `detect.py`); the comments
name the releases only to say when a branch can go.

- `keywords`: the keyword arguments of vLLM's config classes and `Request`, as the installed release wants them;
- `configs`: the `VllmConfig` of an extraction engine;
- `rpc`: calls to the workers (queued or answered, one engine step, deadlines);
- `kv_cache`: the KV budget, layout, groups and config;
- `scheduling`: the scheduler driven by hand, and its requests;
- `process_env`: the environment the workers inherit, CPU thread binding.

Callers name the module (`engine.rpc.submit`), so a test that replaces a function replaces it where it is looked up.
"""
from . import configs, keywords, kv_cache, process_env, rpc, scheduling  # noqa: F401 - the package's modules
