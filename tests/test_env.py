"""Multi-turn episodes (``megarl.env``): the token path (the trainer's sequence is the prompt, the sampled ids and
the observations' delta-rendered ids, exactly; nothing re-encoded), the chat templates it renders with, the built-in
tool environment, and misbehaving environments and tools, each costing exactly its own episodes.

The rollout runs through ``EpisodeRunner.rollout`` on a one-rank gloo group with a scripted engine (the engines'
own runs are in tests/test_rl_e2e.py): its samples are what the script says, so every token can be checked."""

import dataclasses
import os

import pytest
import torch.distributed as dist

from megarl.config.schema import EnvConfig, SamplingConfig
from megarl.data import Prompt
from megarl.env.calls import env_calls
from megarl.env.episodes import EpisodeRunner, scored
from megarl.env.render import BASE, Renderer, TemplateError
from megarl.env.tools import ToolEnv, calculator, parse_hermes
from megarl.env.workers import Environments
from megarl.rewards.results import Failure, ScoreResult
from megarl.rollout.protocol import RolloutStats, Sample

HERE = os.path.dirname(os.path.abspath(__file__))
ENVS = os.path.join(HERE, "envs.py")
QWEN2_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
THINK_DROPPING = (  # Qwen3's rule: an assistant message before the last user message loses its <think> block
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m['role'] == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' "
    "and loop.index0 < ns.last %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "f"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from megarl.models.tiny import save_byte_tokenizer

    out = str(tmp_path_factory.mktemp("byte"))
    save_byte_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory):
    """A byte-level BPE with ChatML's special tokens and one merge, '1' '2' -> '12' (Qwen2-style template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    vocab["12"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("1", "2")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=specials)  # fmt: skip
    fast.chat_template = QWEN2_CHATML
    out = str(tmp_path_factory.mktemp("bpe"))
    fast.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


class ScriptEngine:
    """An engine whose turn k of every episode is ``script(k, prompt_ids)`` (text, encoded, plus EOS), with log-prob
    -0.5 - k / 10 per token and weight version 3; it keeps every request's prompt."""

    tp = 1

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.requests = tokenizer, script, []

    def generate(self, prompts, prompt_indices, seeds, sampling, on_group=None):
        samples = []
        for p, i in zip(prompts, prompt_indices):
            k = sum(1 for q in self.requests if q[1] == i and len(q[0]) < len(p) and p[: len(q[0])] == q[0])
            self.requests.append((list(p), i))
            ids = self.script(k, p)[: sampling.max_new_tokens]
            reason = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
            samples.append(Sample(i, 0, list(p), ids, [-0.5 - k / 10] * len(ids), reason, [3] * len(ids)))
        return samples, RolloutStats(0.0, sum(len(s.token_ids) for s in samples))


def _prompts(texts):
    return [Prompt(i, [], t, None, {}, t) for i, t in enumerate(texts)]


def _runner(tokenizer, cls, **env):
    cfg = EnvConfig(class_=cls, **{"num_workers": 0, "max_turns": 3, "max_total_tokens": 400, **env})
    return EpisodeRunner(cfg, tokenizer, max_model_len=512)


def _rollout(runner, engine, prompts, n=1, max_new=64):
    return runner.rollout(engine, prompts, step=1, sampling=SamplingConfig(n=n, max_new_tokens=max_new), seed=0)[0]


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_the_trainer_s_sequence_is_prompt_sampled_ids_and_delta_rendered_observations(which, request):
    tok = request.getfixturevalue(f"{which}_tokenizer")
    eos = tok.eos_token_id
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    turns = [[one, two, eos], tok("fine", add_special_tokens=False)["input_ids"] + [eos]]  # "1" "2": never merged
    engine = ScriptEngine(tok, lambda k, p: turns[k])
    with _runner(tok, f"{ENVS}:EchoEnv") as runner:
        (s,) = _rollout(runner, engine, _prompts(["copy 12"]))
        render = Renderer(tok)
        prompt = render.prompt_ids([{"role": "user", "content": "say copy 12"}], [])
        observation = render.observation_ids([{"role": "user", "content": "you said '12'; again"}])  # the action's
    assert s.prompt_ids == prompt
    assert s.token_ids == turns[0] + observation + turns[1]
    assert engine.requests[1][0] == prompt + turns[0] + observation  # turn 2's prompt: the sequence so far
    assert s.mask == [1] * 3 + [0] * len(observation) + [1] * len(turns[1])
    assert s.logprobs == [-0.5] * 3 + [0.0] * len(observation) + [-0.6] * len(turns[1])
    assert s.weight_versions == [3] * len(s.token_ids)
    assert s.turn_ends == [2, len(s.token_ids) - 1] and s.turn_rewards == [0.03, len(turns[1]) / 100]
    assert s.env["turns"] == 2 and s.env["observation_tokens"] == len(observation) and s.env_error is None
    assert tok.decode(s.response_ids, skip_special_tokens=True) == "fine"  # what a reward function reads
    if which == "bpe":  # decoding the history and encoding it again is not what the model produced
        again = tok(tok.decode(prompt + s.token_ids), add_special_tokens=False)["input_ids"]
        assert again != prompt + s.token_ids and tok.convert_tokens_to_ids("12") in again
        assert [one, two] == s.token_ids[:2]


def test_observations_render_against_a_fixed_base_under_a_template_that_rewrites_history(bpe_tokenizer):
    """Qwen3's template drops an earlier turn's <think> block: the history rendered again is not a prefix of the
    longer rendering (a suffix-of-the-history rule would refuse it), the base-conversation delta is unaffected."""
    tok = bpe_tokenizer
    tok.chat_template = THINK_DROPPING
    try:
        history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>a"}]
        new = [{"role": "user", "content": "again"}]
        short = tok.apply_chat_template(history, tokenize=False)
        assert not tok.apply_chat_template(history + new, tokenize=False).startswith(short)
        delta = tok.decode(Renderer(tok).observation_ids(new))
        assert delta == "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    finally:
        tok.chat_template = QWEN2_CHATML


def test_a_template_that_renders_a_conversation_s_start_differently_is_refused_in_one_line(byte_tokenizer):
    tok = byte_tokenizer
    saved = tok.chat_template
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        with pytest.raises(TemplateError, match=r"^env: the chat template renders .* differently") as e:
            Renderer(tok)
        assert "\n" not in str(e.value)
    finally:
        tok.chat_template = saved
    assert len(BASE) == 2


def test_the_tiny_template_is_append_only_with_tools(byte_tokenizer):
    tok = byte_tokenizer
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    chat = [{"role": "user", "content": "3*4?"}]
    prompt = tok.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    answer = {"role": "assistant", "content": '<tool_call>{"name": "calculator"}</tool_call>'}
    whole = tok.apply_chat_template([*chat, answer, {"role": "tool", "content": "12"}], tools=tools,
                                    add_generation_prompt=True, tokenize=False)  # fmt: skip
    delta = tok.decode(Renderer(tok).observation_ids([{"role": "tool", "content": "12"}]))
    assert whole == prompt + answer["content"] + "</s>" + delta  # the sampled EOS, then the delta: the whole history


def test_hermes_tool_calls_are_parsed_and_malformed_ones_said():
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
    assert parse_hermes("x " + good) == [{"name": "calculator", "arguments": {"expression": "3*4"}}]
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[0]["arguments"] == {"a": 1}
    bad = parse_hermes("<tool_call>{nope}</tool_call><tool_call>[1]</tool_call><tool_call>{")
    assert bad[0].startswith("the tool call is not JSON") and bad[1].startswith("a tool call is")
    assert parse_hermes("<tool_call>{") == ["a <tool_call> without its </tool_call>"]
    assert parse_hermes("the answer is 12") == []
    assert calculator("3 * (4 + 5)") == "27" and calculator("7/2") == "3.5"


def test_the_tool_environment_answers_calls_counts_errors_and_ends_on_an_answer():
    env = ToolEnv([f"{ENVS}:add", f"{ENVS}:raises"])
    assert [s["function"]["name"] for s in env.tool_schemas()] == ["add", "raises"]
    assert env.reset({"prompt": "2+3?"}) == [{"role": "user", "content": "2+3?"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    obs, reward, done, info = env.step(call + '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', [])
    assert obs[0] == {"role": "tool", "content": "5"} and obs[1]["content"].startswith("error: no tool named 'nope'")
    assert (reward, done, info) == (0.0, False, {"tool_calls": 2.0, "tool_errors": 1.0})
    obs, _, _, info = env.step('<tool_call>{"name": "raises", "arguments": {"a": 7}}</tool_call>', [])
    assert obs == [{"role": "tool", "content": "error: ValueError: seven"}] and info["tool_errors"] == 1.0
    obs, _, _, _ = env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', [])
    assert "missing 1 required positional argument" in obs[0]["content"]
    assert env.step("5", []) == (None, 0.0, True, {"tool_calls": 0.0, "tool_errors": 0.0})


def test_an_environment_s_values_are_checked_per_episode():
    spec = (f"{ENVS}:BadObservation", {})
    reset = env_calls(["e", "e"], [spec, spec], [None, None], [("reset", {"prompt": "7"}), ("reset", {"prompt": "1"})])
    stepped = env_calls(["e", "e"], [spec, spec], [r["state"] for r in reset], [("step", "x", [1])] * 2)
    assert isinstance(stepped[0], Failure) and "observation is a str" in stepped[0].message
    assert stepped[1]["observation"][0]["content"].startswith("you said")
    (failed,) = env_calls(["e"], [("megarl.env.toy:RepeatEnv", {"nope": 1})], [None], [("reset", {"prompt": "p"})])
    assert isinstance(failed, Failure)  # a constructor that fails is the episode's failure too


def _bad_digit_script(tok, call):
    """Turn 0: a tool call (``call(digit)``) or, for environments, an answer; turn 1: an answer."""

    def script(k, p):
        digit = [c for c in tok.decode(p) if c.isdigit()][-1]  # the prompt's ("copy 7"), after the tool schemas
        text = call(digit) if k == 0 and call else f"answer {digit}"
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    return script


MISBEHAVING = [("Hangs", "timeout"), ("Raises", "error"), ("Exits", "error"), ("Kills", "error"),
               ("BadObservation", "error")]  # fmt: skip
BAD_TOOLS = [("slow", "timeout"), ("exits", "error"), ("dies", "error"), ("not_a_string", "error")]


@pytest.mark.parametrize("env, tool, kind", [(f"{ENVS}:{c}", None, k) for c, k in MISBEHAVING]
                         + [("builtin:tools", t, k) for t, k in BAD_TOOLS])  # fmt: skip
def test_a_misbehaving_environment_or_tool_costs_exactly_its_own_episodes(byte_tokenizer, env, tool, kind):
    tok = byte_tokenizer
    call = None
    if tool:
        call = lambda d: f'<tool_call>{{"name": "{tool}", "arguments": {{"a": {d}}}}}</tool_call>'  # noqa: E731
    extra = {"tools": [f"{ENVS}:{tool}"]} if tool else {}
    cfg = EnvConfig(class_=env, num_workers=2, timeout_s=6.0, max_turns=3, max_total_tokens=1000, **extra)
    runner = EpisodeRunner(cfg, tok, max_model_len=1024)  # a tool's schema: some 300 byte tokens of the prompt
    try:
        engine = ScriptEngine(tok, _bad_digit_script(tok, call))
        samples = _rollout(runner, engine, _prompts(["copy 7", "copy 1", "copy 2"]), n=2, max_new=128)
        restarts = runner.envs.pool.restarts
    finally:
        runner.close()
    failed = [s.prompt_index for s in samples if s.env_error]
    assert failed == [0, 0], [s.env_error for s in samples]
    assert all(s.env_error.startswith(kind) for s in samples[:2])
    assert all(s.env["errors"] == 1.0 and s.env["timeouts"] == float(kind == "timeout") for s in samples[:2])
    assert all(s.env["turns"] == 2 and s.env_error is None for s in samples[2:])  # the others finished
    killed = kind == "timeout" or env.endswith("Kills") or tool == "dies"  # sys.exit is caught: the worker stays
    assert restarts == (2 if killed else 0)  # a worker replaced per failed episode
    result = scored(samples, ScoreResult([1.0] * 6, [""] * 6))
    assert result.scores[:2] == [0.0, 0.0] and all(x >= 1.0 for x in result.scores[2:])


def test_episodes_end_at_the_token_limit_and_say_so(byte_tokenizer):
    tok = byte_tokenizer
    long = tok("x" * 30, add_special_tokens=False)["input_ids"]
    with _runner(tok, f"{ENVS}:EchoEnv", max_total_tokens=60) as runner:
        (s,) = _rollout(runner, ScriptEngine(tok, lambda k, p: long), _prompts(["go"]), max_new=40)
    assert len(s.prompt_ids) + len(s.token_ids) == 60 and s.env["truncated"] == 1.0
    assert s.finish_reason == "length" and s.turn_ends == [29]  # turn 1: 30 tokens; its observation was cut


def test_episodes_of_a_step_are_generated_together_turn_by_turn(byte_tokenizer):
    tok = byte_tokenizer
    engine = ScriptEngine(tok, lambda k, p: tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, *a, **k: (calls.append(len(prompts)), generate(prompts, *a, **k))[1]
    with _runner(tok, f"{ENVS}:EchoEnv") as runner:
        samples = _rollout(runner, engine, _prompts(["a", "b", "c"]), n=2)
    assert calls == [6, 6] and len(samples) == 6  # every episode's turn in one engine call


def test_a_bad_environment_is_refused_before_launch_in_one_line(tmp_path, tiny_llama_dir):
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate
    from megarl.run.preflight import check_inputs

    broken = tmp_path / "broken_env.py"
    broken.write_text("import nope\n")
    for spec, message in ((f"{broken}:Env", "No module named 'nope'"), (f"{ENVS}:add", "is not a class with"),
                          ("builtin:nothing", "unknown environment")):  # fmt: skip
        cfg = load_config("configs/tiny_multiturn.yaml", [f"model.path={tiny_llama_dir}", f"env.class={spec}"])
        with pytest.raises(ConfigError, match=r"^env: ") as e:
            check_inputs(cfg)
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    validate(load_config("configs/tiny_multiturn_bounded.yaml", [f"model.path={tiny_llama_dir}"]))  # streamed
    with pytest.raises(ConfigError, match="algorithm.overlong penalises"):
        validate(load_config("configs/tiny_dapo.yaml", [f"model.path={tiny_llama_dir}", "env.class=builtin:repeat"]))
    cfg = load_config("configs/tiny_tools.yaml", [f"model.path={tiny_llama_dir}"])
    assert cfg.env.class_ == "builtin:tools" and cfg.reward.function == "toy_digits"
    assert load_config("configs/tiny_multiturn.yaml").reward.function == ""
    assert dataclasses.asdict(cfg.env)["tools"] == ["megarl.env.tools:calculator"]


def test_environment_calls_run_in_workers_like_in_the_trainer_s_process(byte_tokenizer):
    spec = EnvConfig(class_=f"{ENVS}:EchoEnv", kwargs={"greeting": "hey"}, num_workers=1)
    envs = Environments(spec)
    try:
        (a,) = envs.call([None], [("reset", {"prompt": "p"})])
    finally:
        envs.close()
    (b,) = env_calls(["e"], [(spec.class_, spec.kwargs)], [None], [("reset", {"prompt": "p"})])
    assert a["prompt"] == b["prompt"] == [{"role": "user", "content": "hey p"}]


def _episode(mask, turn_ends, turn_rewards, prompt_index=0):
    ids = list(range(3, 3 + len(mask)))
    return Sample(prompt_index, 0, [1], ids, [-1.0] * len(ids), "stop", [0] * len(ids), mask=mask,
                  turn_ends=turn_ends, turn_rewards=turn_rewards)  # fmt: skip


def test_per_turn_credit_puts_each_turn_s_reward_at_its_last_model_token():
    """Written from the definition: model tokens [a a | b] (an observation between), turn rewards 0.3 and 0.5, the
    episode's reward 1.0 (0.2 from the reward function): 0.3 on the first turn's last token, 0.5 + 0.2 on the last."""
    import torch

    from megarl.rl.collect import Collected
    from megarl.rl.step import turn_credit

    batch = Collected(samples=[_episode([1, 1, 0, 0, 1, 0], [1, 4], [0.3, 0.5]), Sample(1, 0, [1], [5, 6], [-1.0] * 2,
                      "stop", [0, 0])], rewards=[1.0, 0.7])  # fmt: skip
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    out = turn_credit(batch, mask)
    assert torch.allclose(out, torch.tensor([[0.0, 0.3, 0.7], [0.0, 0.7, 0.0]]))
    assert torch.allclose(out.sum(-1), torch.tensor(batch.rewards))


def test_the_environment_s_reward_survives_a_reward_model_without_a_function():
    from megarl.config.schema import RewardConfig, RewardModelConfig
    from megarl.rl.collect import Collected, combine_rewards

    cfg = RewardConfig(function="", model=RewardModelConfig(path="rm"), combine={"model": 0.5})
    samples = [_episode([1, 0, 1], [0, 2], [0.25, 0.5]), _episode([1], [0], [0.0])]
    result = scored(samples, ScoreResult([0.0, 0.0], ["", ""]))  # no function: its part is 0
    batch = Collected(samples=samples, scores=result.scores, rewards=list(result.scores))
    combine_rewards(cfg, batch, [2.0, -2.0])
    assert batch.rewards == [0.75 + 0.5 * 2.0, -1.0] and batch.scores == batch.rewards


def test_an_episode_s_limits_must_fit_the_prompt_and_the_training_sequence(tiny_llama_dir):
    from megarl.config.loader import ConfigError, load_config
    from megarl.config.validate import validate

    base = ["configs/tiny_multiturn.yaml", [f"model.path={tiny_llama_dir}"]]
    with pytest.raises(ConfigError, match=r"env.max_total_tokens=16 leaves no room for a turn after a prompt"):
        validate(load_config(base[0], [*base[1], "env.max_total_tokens=16"]))
    with pytest.raises(ConfigError, match=r"env.max_total_tokens=200 exceeds actor.seq_length=128"):
        validate(load_config(base[0], [*base[1], "env.max_total_tokens=200"]))


def test_tool_calls_beyond_the_limit_are_answered_with_an_error():
    env = ToolEnv([f"{ENVS}:add"], max_calls=1)
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    obs, _, _, info = env.step(call * 2, [])
    assert [m["content"] for m in obs] == ["2", "error: at most 1 tool calls per turn; this one was not run"]
    assert info == {"tool_calls": 2.0, "tool_errors": 1.0}


@pytest.mark.parametrize("workers", [0, 1])
def test_streamed_calls_answer_as_they_finish_and_a_saved_environment_continues_from_its_state_dict(workers):
    """``Environments.submit``/``done`` (the bounded stream's calls): each answer once, as it comes, while the
    caller goes on; a call past env.timeout_s fails alone. An environment with
    ``state_dict`` is rebuilt from a checkpoint's copy and goes on counting its turns (tests/envs.py:AlwaysCalls:
    one tool call, then the answer); one without (ForgetfulCalls) saves nothing."""
    import time

    cfg = EnvConfig(class_=f"{ENVS}:AlwaysCalls", kwargs={"tools": ["megarl.env.tools:calculator"], "calls": 1},
                    num_workers=workers, timeout_s=60.0)  # fmt: skip
    envs = Environments(cfg)
    try:
        envs.submit("a", None, ("reset", {"prompt": "1+2"}))
        got = {}
        deadline = time.monotonic() + 120
        while "a" not in got and time.monotonic() < deadline:
            got.update(envs.done())
        assert got["a"]["saved"]["state_dict"]["turn"] == 0 and envs.done() == []
        envs.submit("b", got["a"]["saved"], ("step", "3", [1]))  # rebuilt from the state_dict: its first turn
        envs.submit("c", got["a"]["state"], ("step", "3", [1]))  # the pickle between turns
        while len(got) < 3 and time.monotonic() < deadline:
            got.update(envs.done())
        for key in "bc":
            assert got[key]["info"]["tool_calls"] == 1 and not got[key]["done"], got[key]
            assert got[key]["saved"]["state_dict"]["turn"] == 1
        assert got["b"]["info"]["resumed"] == 1.0 and got["c"]["info"]["resumed"] == 0.0
        final = dict(got)
        envs.submit("d", got["b"]["state"], ("step", "no call", [1]))  # the second turn: the answer
        while "d" not in final and time.monotonic() < deadline:
            final.update(envs.done())
        assert final["d"]["done"] and final["d"]["saved"] is None and final["d"]["info"]["tool_calls"] == 0
        if workers:  # a hanging call fails alone (env.timeout_s); a cancelled one never answers
            hang = EnvConfig(class_=f"{ENVS}:Hangs", num_workers=1, timeout_s=5.0)
            slow = Environments(hang)
            try:
                slow.submit("h", None, ("reset", {"prompt": "7"}))
                answers = {}
                while "h" not in answers:
                    answers.update(slow.done())
                slow.submit("h", answers["h"]["state"], ("step", "x", [1]))
                answers = {}
                while "h" not in answers and time.monotonic() < deadline:
                    answers.update(slow.done())
                assert isinstance(answers["h"], Failure) and "env.timeout_s" in answers["h"].message
                assert slow.pool.run is None  # every part handed back: nothing held
            finally:
                slow.close()
    finally:
        envs.close()
    forgetful = env_calls(["e"], [(f"{ENVS}:ForgetfulCalls", {"tools": ["megarl.env.tools:calculator"]})], [None],
                          [("reset", {"prompt": "1"})])[0]  # fmt: skip
    assert forgetful["saved"] is None
