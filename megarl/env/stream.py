"""Episodes in the bounded stream (``async_training.mode=bounded``): a ``StreamSession`` whose requests are turns.

The rollout pool's server (``megarl.rl.bounded.RolloutServer``) drives an ``EpisodeStream`` as it drives a
``StreamSession``: ``submit`` a prompt group, ``step`` the engine, take whole groups as they finish. Here a group's
samples are episodes. Each starts with its environment's ``reset`` (in the environments' worker processes, on one rank
of the engine), then alternates: a turn's request in the engine, submitted as the episode's whole token sequence so
far (token-in-token-out); when it finishes, the environment's ``step`` runs in the workers while the engine goes on
with the other requests; its answer appends the observation's tokens and submits the next turn. ``exchange`` (every
loop of the server, collective over the pool) hands the answers that came back to every rank of the episode's engine,
which submit the next turns in the same order.

A weight push pre-empts the turns in flight like any request (partial rollout): an episode's tokens carry the version
that sampled them and its observation tokens the version of the turn they follow. Every later token of an episode is
from a version at least its first token's, so the admission rule bounds an episode's oldest token as a sample's.

A checkpoint (``snapshot``) holds every episode not handed back: its tokens, masks, versions, turns, the turn in
flight, and its environment's ``state_dict()`` after its last call when the class has one (``load_state_dict`` on
resume). ``restore`` continues those from their last completed call (a turn in flight continues as a partial
request; a call in flight runs again); an episode whose environment has no ``state_dict`` starts over (a new seed
segment), counted in ``env/restarted_on_resume``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch.distributed as dist

from megarl.env.episodes import Episode, EpisodeRunner, public, reset_action, shared, turn_seed
from megarl.rewards.results import Failure
from megarl.rollout.protocol import Sample
from megarl.rollout.stream import Request, StreamSession

SNAPSHOT_DROPS = ("state", "owner")
"""Episode fields a checkpoint does not hold: the pickled environment (its ``saved`` state_dict is what persists)
and the owner (recomputed from the resumed layout)."""


class EpisodeStream:
    """``StreamSession``'s interface (``submit``, ``step``, ``in_flight``, ``snapshot``, ``restore``, ``abort``) for
    episodes, plus ``exchange``."""

    def __init__(self, session: StreamSession, runner: EpisodeRunner, tp: int):
        """``session``: the engine's stream of turns; ``runner``: the job's environments and limits; ``tp``: ranks
        per engine (an episode's calls run on rank ``serial % tp`` of its engine)."""
        self.session, self.runner, self.tp = session, runner, tp
        self.episodes: dict[str, Episode] = {}
        """Every episode of the groups submitted and not handed back (finished ones wait for their group)."""
        self.held: list[Episode] = []
        """Episodes whose next turn waits for a weight push (``partial_rollout: none``: the push waits for the
        engine to empty, so no turn starts meanwhile)."""

    @property
    def in_flight(self) -> int:
        """Turns in the engine (an episode waiting for its environment is not)."""
        return self.session.in_flight

    @property
    def samplings(self) -> dict:
        return self.session.samplings

    def submit(self, serial: int, prompt_ids: list[int], seed: int, kind: str = "train", segment: int = 0,
               record: dict | None = None) -> None:  # fmt: skip
        """Start prompt ``serial``'s ``n`` episodes (episode ``i`` with seed ``seed + i``) from ``record`` (what
        ``reset`` gets; its prompt when ``reset`` returns None)."""
        for i in range(self.samplings[kind].n):
            e = Episode(serial, i, record or {}, seed + i, list(prompt_ids), self._owns(serial), kind=kind,
                        segment=segment)  # fmt: skip
            self.episodes[e.key] = e
            self._call(e, None, reset_action(e))

    def _owns(self, serial: int) -> bool:
        return serial % self.tp == dist.get_rank() % self.tp

    def _call(self, e: Episode, state, action: tuple) -> None:
        e.waiting = action[0]
        if e.owner:
            self.runner.envs.submit(e.key, state, action)

    def _turn(self, e: Episode) -> None:
        """Submit the episode's next turn: its whole sequence so far, the room left as its budget."""
        request = Request(e.prompt_index, e.sample_index, e.prompt_ids + e.tokens, turn_seed(e, len(e.turn_ends)),
                          segment=e.segment, kind=e.kind)  # fmt: skip
        self.session.add(request, self.runner.limit(e, self.samplings[e.kind]))

    def step(self) -> list[list[Sample]]:
        """One engine step: the turns it finished go to their environments (or end their episodes); the groups
        that ended."""
        ended = []
        for r in self.session.step_requests():
            del self.session.requests[r.request_id]
            e = self.episodes[r.request_id]
            self.runner.turn_done(e, r.token_ids, r.logprobs, r.weight_versions, r.finish_reason)
            if e.failure is not None:  # its reset failed: one turn from the dataset's prompt, scored 0
                e.done = True
                ended.append(e)
            else:
                self._call(e, e.state, self.runner.step_action(e))
        return self._groups(ended)

    def exchange(self, hold: bool = False) -> list[list[Sample]]:
        """Collective over the rollout pool: the environments' answers so far to every rank of their engine; each
        episode goes on (its next turn submitted; held back while ``hold``) or ends. The groups that ended."""
        if not hold:
            for e in self.held:
                self._turn(e)
            self.held = []
        mine = {}
        for key, answer in self.runner.envs.done():
            if key in self.episodes:  # else: dropped meanwhile (a resume)
                mine[key] = public(self.episodes[key], answer)
        answers = shared(mine) if dist.get_world_size() > 1 else mine
        ended = []
        for key, got in answers.items():
            e = self.episodes.get(key)
            if e is None or e.waiting is None:  # another engine's
                continue
            if e.waiting == "reset":
                self.runner.started(e, got)
            else:
                self.runner.answered(e, got)
            if e.done:
                ended.append(e)
            elif hold:
                self.held.append(e)
            else:
                self._turn(e)
        return self._groups(ended)

    def _groups(self, ended: list[Episode]) -> list[list[Sample]]:
        """The groups whose episodes have all ended, as samples (handed back: they leave the stream)."""
        done = []
        for e in ended:
            n = self.samplings[e.kind].n
            group = [self.episodes.get(f"{e.prompt_index}.{i}") for i in range(n)]
            if all(g is not None and g.done for g in group):
                done.append([g.sample() for g in group])
                for g in group:
                    del self.episodes[g.key]
        return done

    def drop(self, kind: str) -> None:
        """Forget the episodes of one sampling (``'val'``: a validation cut by a stop); their calls' answers are
        ignored when they come."""
        self.session.drop(kind)
        for key in [k for k, e in self.episodes.items() if e.kind == kind]:
            del self.episodes[key]
        self.held = [e for e in self.held if e.kind != kind]

    def abort(self) -> None:
        """Abort the turns in flight (the engine can serve another job); the environments' calls in flight end with
        the job's workers."""
        self.session.abort()
        self.episodes, self.held = {}, []

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """Every episode not handed back, as plain data: its fields, the turn in flight (``turn``: tokens so far),
        and the keys the server's resume reads (``serial``, ``segment``, ``kind``, ``finish_reason``: None while
        running, ``weight_versions``: every token's so far)."""
        out = []
        for key, e in self.episodes.items():
            d = {k: copy.deepcopy(v) for k, v in vars(e).items() if k not in SNAPSHOT_DROPS}
            r = self.session.requests.get(key)
            d["turn"] = None if r is None else {"token_ids": list(r.token_ids), "logprobs": list(r.logprobs),
                                                "weight_versions": list(r.weight_versions), "seed": r.seed}  # fmt: skip
            d["episode_finish_reason"] = e.finish_reason  # the episode's; the server reads finish_reason
            d.update(serial=e.prompt_index, finish_reason=e.finish_reason if e.done else None,
                     weight_versions=e.versions + (d["turn"]["weight_versions"] if r is not None else []))
            if e.failure is not None:
                d["failure"] = dataclasses.asdict(e.failure)
            out.append(d)
        return out

    def restore(self, requests: list[dict], seed_of) -> None:
        """Continue a ``snapshot``'s episodes: an ended one waits for its group; one whose environment was saved
        continues from its last completed call (the call in flight again, or its turn as a partial request with a
        new seed segment, ``seed_of(serial, segment) + sample_index``); one whose environment cannot be saved starts
        over (``env/restarted_on_resume``)."""
        for d in requests:
            fields = {k: copy.deepcopy(v) for k, v in d.items() if k in Episode.__dataclass_fields__}
            fields["finish_reason"] = d.get("episode_finish_reason", d["finish_reason"] or "stop")
            if fields.get("failure") is not None:
                fields["failure"] = Failure(**fields["failure"])
            e = Episode(**fields, owner=self._owns(d["serial"]))
            self.episodes[e.key] = e
            if e.done:
                continue
            e.segment += 1
            e.seed = seed_of(e.prompt_index, e.segment) + e.sample_index
            if e.waiting == "reset":
                self._call(e, None, reset_action(e))
            elif e.failure is None and e.saved is None:  # its environment cannot continue: the episode starts over
                self._restart(e)
            elif e.waiting == "step":
                self._call(e, e.saved, self.runner.step_action(e))
            else:
                self._resume_turn(e, d["turn"])

    def _restart(self, e: Episode) -> None:
        fresh = Episode(e.prompt_index, e.sample_index, e.record, e.seed, list(e.source_ids), e.owner, kind=e.kind,
                        segment=e.segment)  # fmt: skip
        fresh.stats["restarted_on_resume"] = 1.0
        self.episodes[e.key] = fresh
        self._call(fresh, None, reset_action(fresh))

    def _resume_turn(self, e: Episode, turn: dict | None) -> None:
        """The turn in flight at the save, continued: its tokens so far stay, the rest samples with the new seed."""
        e.state = e.saved
        request = Request(e.prompt_index, e.sample_index, e.prompt_ids + e.tokens,
                          turn_seed(e, len(e.turn_ends)), segment=e.segment, kind=e.kind)  # fmt: skip
        if turn is not None:
            request.token_ids, request.logprobs = list(turn["token_ids"]), list(turn["logprobs"])
            request.weight_versions = list(turn["weight_versions"])
        budget = self.runner.limit(e, self.samplings[e.kind]) - len(request.token_ids)
        if budget <= 0:  # the turn had used its budget: it ends here
            self.runner.turn_done(e, request.token_ids, request.logprobs, request.weight_versions, "length")
            self._call(e, e.state, self.runner.step_action(e))
            return
        self.session.add(request, budget)
