"""Multi-turn episodes: an environment (or tools) answers each model turn; the trainer's sequence is the prompt, then
each turn's sampled tokens and the observation's rendered tokens, never re-tokenised (docs/agents.md).

- ``calls``: what runs in the worker processes (an environment's ``reset`` and ``step``), checked there;
- ``render``: chat messages to token ids (a prompt, an observation's delta against a fixed base conversation);
- ``tools``: the built-in tool-calling environment (``env.class: builtin:tools``) and its parser;
- ``toy``: the built-in toy environment (``builtin:repeat``);
- ``workers``: where the calls run (worker processes, or this process); ``preload``: what a worker loads;
- ``episodes``: the rollout of a step's episodes through the engines, turn by turn.
"""
