"""builtin:repeat whose ``step`` first sleeps ``sleep_s`` (a tool or a sandbox that takes its time), for
benchmarks/agent_step.py."""

import time

from megarl.env.toy import RepeatEnv


class SlowRepeat(RepeatEnv):
    def __init__(self, sleep_s: float = 0.2, turns: int = 2):
        super().__init__(turns)
        self.sleep_s = sleep_s

    def step(self, text, token_ids):
        time.sleep(self.sleep_s)
        return super().step(text, token_ids)
