"""The agent layer (issue 6): multi-turn episodes with tools, recorded as exact trajectories.

Modules, one job each:

    template     render a conversation to token ids through the chat template
    trajectory   token ids + loss mask + behaviour logprobs + policy versions, built turn by turn (TITO)
    messages     OpenAI-style messages: validation, the client's view vs the template's view
    toolcalls    pluggable tool-call parsers (Hermes/Qwen <tool_call> JSON by default)
    tools        tools (calculator, python/bash in a sandbox) and their registry
    generator    where turns are generated: an in-process engine, or an engine/router over HTTP
    session      one episode: limits, turns, reconciliation of OpenAI-style requests
    client       an OpenAI-style client bound to one session, in process
    episode      the `step` interface and the episode loop
    proxy        the black-box proxy: an OpenAI-compatible endpoint per session over HTTP
    verify       proof that the trajectory holds exactly what the engine sampled
    check        `rollwise check tito`
    samples      trajectories -> trainer Samples (loss mask), per-episode GRPO advantages
    rollout      GRPO groups of tool-using episodes on threads
    config       the `agent:` section of a run config
    controller   `rollwise train` with an `agent:` section (the rollout controller's interface)
    toy          a tiny model taught to call the calculator (tests and checks)
"""
