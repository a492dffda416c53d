"""Token-in/token-out over multi-turn conversations with tool calls, on a real reference engine.

The model is a tiny Llama taught (in seconds, cached) to write Hermes tool calls, sampled at
temperature 1: real tool calls, malformed ones, unknown tools, and cut-off turns all occur.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from rollwise.agent.episode import ToolAgent, run_episode
from rollwise.agent.generator import LocalGenerator
from rollwise.agent.session import AgentSession, SessionLimits
from rollwise.agent.template import ChatRenderer
from rollwise.agent.tools import CalculatorTool, ToolRegistry
from rollwise.agent.toy import toy_question, toy_tool_model
from rollwise.agent.trajectory import NO_VERSION, TrajectoryBuilder
from rollwise.agent.verify import RecordingGenerator, verify_trajectory
from rollwise.engine.factory import create_engine
from rollwise.types.generation import Completion, SamplingParams
from rollwise.model.tiny import CHATML_TEMPLATE, SPECIAL_TOKENS, tiny_llama

pytestmark = [pytest.mark.usefixtures("single_torch_thread"), pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def toy():
    model, tokenizer = toy_tool_model(seed=0)
    engine = create_engine("reference", model, tokenizer, max_num_seqs=8, max_model_len=768,
                           eos_token_ids=[tokenizer.eos_token_id], seed=0)
    generator = LocalGenerator(engine)
    yield model, tokenizer, generator
    generator.close()


def _episode(toy, seed: int, limits: SessionLimits | None = None, template: str | None = None):
    model, tokenizer, generator = toy
    recorder = RecordingGenerator(generator)
    registry = ToolRegistry([CalculatorTool()])
    session = AgentSession(recorder, tokenizer, seed=seed, limits=limits or SessionLimits(max_turns=4),
                           chat_template=template)
    agent = ToolAgent(registry)
    result = run_episode(session, toy_question(random.Random(seed)), agent, max_tokens=120)
    return session, recorder, agent, result


def test_multi_turn_tool_episode_is_token_exact(toy):
    model = toy[0]
    saw_call = saw_error = False
    for seed in range(4):
        session, recorder, agent, result = _episode(toy, seed)
        traj = result.trajectory
        assert len(recorder.calls) >= 1 and traj.turns == len(recorder.calls)
        report = verify_trajectory(traj, recorder.calls, model=model)
        assert report.ok, report.violations
        assert not traj.splits  # ChatML keeps the prefix property
        assert max(t.trainer_max_abs_logprob_diff for t in report.turns) < 1e-4
        seg = traj.segments[0]
        # mask 1 exactly on the engine's spans; logprobs/versions only there
        assert sum(seg.loss_mask) == sum(len(c.token_ids) for _, _, c in recorder.calls)
        for i, m in enumerate(seg.loss_mask):
            if not m:
                assert seg.logprobs[i] == 0.0 and seg.versions[i] == NO_VERSION
        # between turns: only template tokens; for this (char-level) tokenizer the canonical rendering
        # of the conversation up to each turn is exactly the prompt the engine was given
        renderer = ChatRenderer(toy[1])
        for (prompt, _, _), span in zip(recorder.calls, seg.spans):
            assert prompt == seg.token_ids[: span.start]
        n_assistant = 0
        for k, msg in enumerate(traj.messages):
            if msg["role"] == "assistant":
                span = seg.spans[n_assistant]
                n_assistant += 1
                if not span.retokenization_drift:
                    assert renderer.render(traj.messages[:k], add_generation_prompt=True) == seg.token_ids[: span.start]
        saw_call |= any(not r.error for r in agent.results)
        saw_error |= any(r.error for r in agent.results)
    assert saw_call, "the taught model made no valid tool call in 4 episodes"


def test_sampled_end_of_turn_kept_template_newline_masked(toy):
    session, recorder, _, result = _episode(toy, 0)
    seg = result.trajectory.segments[0]
    tok = toy[1]
    eos = tok.eos_token_id
    first = seg.spans[0]
    if recorder.calls[0][2].finish_reason == "stop" and len(seg.spans) > 1:
        assert seg.token_ids[first.end - 1] == eos and seg.loss_mask[first.end - 1] == 1
        # ChatML's "\n" after <|im_end|> is the template's: mask 0
        assert tok.decode([seg.token_ids[first.end]]) == "\n" and seg.loss_mask[first.end] == 0


def test_turn_cut_at_max_tokens_gets_template_end_of_turn(toy):
    _, tokenizer, generator = toy
    session = AgentSession(generator, tokenizer, seed=3)
    session.start([{"role": "user", "content": "1+2?"}])
    turn = session.generate(max_tokens=5)
    assert turn.completion.finish_reason == "length"
    session.add_messages([{"role": "user", "content": "go on"}])
    seg = session.trajectory().segments[0]
    span = seg.spans[0]
    assert seg.token_ids[span.start: span.end] == turn.completion.token_ids
    # the end of turn the model did not sample is added by the template, with mask 0
    assert seg.token_ids[span.end] == tokenizer.eos_token_id and seg.loss_mask[span.end] == 0


# A template that rewrites history (as reasoning templates strip earlier turns' thinking): earlier
# assistant turns are shown by their last 4 characters only.
REWRITING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content[-4:] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_breaking_prefix_property_splits_never_retokenizes(toy):
    model = toy[0]
    session, recorder, _, result = _episode(toy, 1, limits=SessionLimits(max_turns=3), template=REWRITING_TEMPLATE)
    traj = result.trajectory
    long_turns = [t for t in session.turns[:-1] if len(t.text) > 4]
    assert long_turns, "the first reply should be longer than 4 characters"
    assert len(traj.segments) == len(recorder.calls) and len(traj.splits) == len(recorder.calls) - 1
    assert "rewrites earlier turns" in traj.splits[0]
    report = verify_trajectory(traj, recorder.calls, model=model)
    assert report.ok, report.violations
    # each segment holds exactly one engine turn, its sampled ids untouched; the new segment's prompt
    # is the canonical rendering (mask 0), which is also exactly what the engine was prompted with
    for seg, (prompt, _, c) in zip(traj.segments, recorder.calls):
        assert seg.token_ids == prompt + list(c.token_ids)
        assert seg.loss_mask == [0] * len(prompt) + [1] * len(c.token_ids)


def test_generation_prompt_not_matching_history_splits(toy):
    # The generation prompt opens a "think:" block that the rendered history does not have.
    template = CHATML_TEMPLATE.replace("'<|im_start|>assistant\n' }}{% endif %}",
                                       "'<|im_start|>assistant\nthink:' }}{% endif %}")
    _, tokenizer, generator = toy
    recorder = RecordingGenerator(generator)
    session = AgentSession(recorder, tokenizer, seed=2, chat_template=template)
    session.start([{"role": "user", "content": "1+1?"}])
    session.generate(max_tokens=20)
    session.add_messages([{"role": "user", "content": "and 2+2?"}])
    session.generate(max_tokens=20)
    traj = session.trajectory()
    assert len(traj.segments) == 2 and "differently from its generation prompt" in traj.splits[0]
    assert verify_trajectory(traj, recorder.calls).ok


def _drifting_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level ChatML tokenizer plus multi-character tokens that encoding never produces: a model
    can sample them, and decode -> encode then gives other ids (BPE is not a bijection either)."""
    import string

    chars = list(dict.fromkeys(string.printable))
    extra = ["ab", "12", " the", "</"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars + ["<unk>"] + extra)}
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<unk>", bos_token=None, additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


def test_non_bijective_tokenizer_keeps_sampled_ids():
    tokenizer = _drifting_tokenizer()
    model = tiny_llama(vocab_size=len(tokenizer), seed=4)
    extra_ids = set(range(len(tokenizer) - 4, len(tokenizer)))
    engine = create_engine("reference", model, tokenizer, max_num_seqs=2, max_model_len=512,
                           eos_token_ids=[tokenizer.eos_token_id], seed=0)
    generator = LocalGenerator(engine)
    try:
        drift_seen = False
        for seed in range(6):
            recorder = RecordingGenerator(generator)
            session = AgentSession(recorder, tokenizer, seed=seed)
            session.start([{"role": "user", "content": "hi"}])
            for k in range(3):
                session.generate(max_tokens=24)
                session.add_messages([{"role": "tool", "content": f"result {k}"}])
            traj = session.trajectory()
            report = verify_trajectory(traj, recorder.calls, model=model)
            assert report.ok, report.violations
            for _, _, c in recorder.calls:
                reencoded = tokenizer.encode(tokenizer.decode(c.token_ids, skip_special_tokens=True),
                                             add_special_tokens=False)
                if set(c.token_ids) & extra_ids:
                    assert reencoded != [t for t in c.token_ids if t != tokenizer.eos_token_id]
                    drift_seen = True
            for span, (_, _, c) in zip(traj.segments[0].spans, recorder.calls):
                if set(c.token_ids) & extra_ids:
                    assert span.retokenization_drift  # reported: a text-based trajectory would be wrong here
        assert drift_seen, "no multi-character token sampled: the test did not exercise drift"
    finally:
        generator.close()


# Qwen3/DeepSeek-R1 style: earlier assistant turns lose their <think>...</think> block.
REASONING_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_probe_reports_breaking_transitions():
    from rollwise.agent.check import probe_template
    from rollwise.model.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    ok = probe_template(ChatRenderer(tok), [tok.eos_token_id])
    assert all(p.keeps_prefix for p in ok), [p for p in ok if not p.keeps_prefix]
    probes = {p.transition: p for p in probe_template(ChatRenderer(tok, REASONING_TEMPLATE), [tok.eos_token_id])}
    assert not probes["assistant (reasoning) -> user"].keeps_prefix
    assert "rewrites earlier turns" in probes["assistant (reasoning) -> user"].detail
    assert probes["assistant -> tool"].keeps_prefix  # no reasoning block: nothing rewritten


def test_check_tito_cli_exits_0_on_the_tiny_model(tmp_path, capsys):
    import json

    from rollwise.cli import main

    out = tmp_path / "tito.json"
    assert main(["check", "tito", "--model", "tiny:0", "--engine", "reference", "--episodes", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["violations"] == [] and result["engine"] == "reference"
    assert sum(len(ep["turns"]) for ep in result["episodes"]) >= 4
    assert all(t["ids_equal"] and t["prompt_is_prefix"] for ep in result["episodes"] for t in ep["turns"])
    assert "TITO holds" in capsys.readouterr().out


def _sampled(builder: TrajectoryBuilder, tokenizer, request_id: str, extra: str) -> Completion:
    """A turn as if sampled: 'a reply ' then the multi-character token `extra` (which encoding never
    produces, so decode -> encode gives other ids) and the end of turn."""
    ids = tokenizer.encode("a reply ", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(extra),
                                                               tokenizer.eos_token_id]
    return Completion(request_id, 0, builder.prompt_ids(), ids, [-0.5] * len(ids), [0] * len(ids), "stop")


@pytest.mark.parametrize("template", [None, REWRITING_TEMPLATE], ids=["chatml", "rewriting"])
def test_drift_is_reported_for_every_turn_including_the_last_and_before_a_split(template):
    # Three drifting turns: one followed by a tool result, one (with the rewriting template) followed by
    # a split, and the session's final turn, followed by nothing. All three must be reported.
    tokenizer = _drifting_tokenizer()
    builder = TrajectoryBuilder(ChatRenderer(tokenizer, template), [tokenizer.eos_token_id], "drift")
    builder.start([{"role": "user", "content": "hi"}])
    calls = []
    for turn, extra in enumerate(["ab", "12", " the"]):
        completion = _sampled(builder, tokenizer, f"turn-{turn}", extra)
        builder.add_completion(completion)
        calls.append((completion.prompt_ids, SamplingParams(max_tokens=8), completion))
        if turn < 2:
            builder.extend([{"role": "tool", "content": f"result {turn}"}])
    traj = builder.trajectory()
    if template is not None:
        assert len(traj.splits) == 2  # each reply is longer than the 4 characters the template keeps
    report = verify_trajectory(traj, calls)
    assert report.ok, report.violations
    assert [t.retokenization_drift for t in report.turns] == [True, True, True]


def test_no_drift_reported_for_turns_that_reencode_exactly():
    tokenizer = _drifting_tokenizer()
    builder = TrajectoryBuilder(ChatRenderer(tokenizer, REWRITING_TEMPLATE), [tokenizer.eos_token_id], "exact")
    builder.start([{"role": "user", "content": "hi"}])
    for turn in range(2):
        ids = tokenizer.encode("plain reply", add_special_tokens=False) + [tokenizer.eos_token_id]
        builder.add_completion(Completion(f"t{turn}", 0, builder.prompt_ids(), ids, [0.0] * len(ids),
                                          [0] * len(ids), "stop"))
        if turn == 0:
            builder.extend([{"role": "user", "content": "more"}])
    traj = builder.trajectory()
    assert len(traj.splits) == 1
    assert not any(span.retokenization_drift for seg in traj.segments for span in seg.spans)
