"""The built-in toy environment (``env.class: builtin:repeat``, data ``builtin:digits``): the model answers the
prompt ("copy 7:"), the environment asks again, and the second answer must repeat the first.

Turn 1 earns half of ``toy_digits``'s score against the digit; turn 2 half of it against the first answer's first
character, so a tiny random model has a dense signal on both turns (``configs/tiny_multiturn.yaml``)."""

from __future__ import annotations

from megarl.rewards.toy import digit_score

AGAIN = "again:"


class RepeatEnv:
    def __init__(self, turns: int = 2):
        self.turns = turns
        self.answers: list[str] = []
        self.answer = ""

    def reset(self, record: dict):
        self.answer = str(record.get("ground_truth") or record.get("answer") or "")
        return [{"role": "user", "content": str(record["prompt"])}]

    def step(self, text: str, token_ids: list[int]):
        text = text.strip()
        target = self.answer if not self.answers else (self.answers[0][:1] or "?")
        self.answers.append(text)
        done = len(self.answers) >= self.turns
        reward = 0.5 * digit_score(text, target)
        observation = None if done else [{"role": "user", "content": AGAIN}]
        return observation, reward, done, {"repeated": float(len(self.answers) > 1 and text == self.answers[0])}
