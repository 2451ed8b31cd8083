"""A scripted continuous-batching engine (engines/generation/router.py `StreamingEngine`) for the
request-stream tests (tests/engines/generation/test_request_stream.py): request k's response is `length` tokens, where
`length` is the prompt's first token id; each step adds one token to every running request, so a
short request added late finishes before a long one added early. A prompt whose first token is 0
fails the step it is in (an engine error); `version` is the policy it serves."""

from __future__ import annotations

import threading

from engines.generation.router import RequestDelta
from engines.generation.request_stream import RequestStream


class ScriptedStreamingEngine:
    def __init__(self, version: int = 3, step_s: float = 0.0):
        self.version, self.step_s = version, step_s
        self.running: dict[str, tuple[int, int]] = {}   # request id -> (tokens wanted, tokens given)
        self.aborted: list[str] = []                    # the router's ids of requests aborted while running
        self.added: list[int] = []                      # first prompt token of every request added
        self.steps = 0
        self._lock = threading.Lock()

    def add_request(self, request_id, prompt_token_ids, params):
        with self._lock:
            self.running[request_id] = (int(prompt_token_ids[0]), 0)
            self.added.append(int(prompt_token_ids[0]))

    def step_deltas(self):
        import time

        time.sleep(self.step_s)
        with self._lock:
            self.steps += 1
            if any(want == 0 for want, _ in self.running.values()):
                raise RuntimeError("scripted engine failure (a prompt starting with token 0)")
            deltas = []
            for rid, (want, given) in list(self.running.items()):
                given += 1
                finished = given >= want
                deltas.append(RequestDelta(rid, [100 + given], [-0.5], "length" if finished else None))
                if finished:
                    del self.running[rid]
                else:
                    self.running[rid] = (want, given)
            return deltas

    def abort_requests(self, request_ids):
        with self._lock:
            for rid in request_ids:
                if self.running.pop(rid, None) is not None:
                    self.aborted.append(rid)

    def decode(self, token_ids):
        return " ".join(map(str, token_ids))


class StreamActor:
    """The GenerationWorker's stream methods over the scripted engine (same RequestStream)."""

    def __init__(self, name: str, version: int, step_s: float, refuse: bool = False):
        self.engine = ScriptedStreamingEngine(version=version, step_s=step_s)
        self.name, self.stream, self.refuse = name, None, refuse

    def is_open(self) -> bool:
        return self.stream is not None

    def stream_open(self) -> int:
        if self.refuse:
            raise ValueError(f"{self.name} refuses to stream")
        self.stream = RequestStream(self.engine, policy_version=self.engine.version, name=self.name)
        return self.engine.version

    def stream_submit(self, rid, prompt, params):
        self.stream.submit(rid, prompt, params)

    def stream_cancel(self, rids):
        self.stream.cancel(rids)

    def stream_collect(self, timeout_s):
        return self.stream.collect(timeout_s)

    def stream_stats(self):
        return self.stream.stats()

    def stream_close(self):
        stream, self.stream = self.stream, None
        return None if stream is None else stream.close()

    def aborted(self):
        return list(self.engine.aborted)
