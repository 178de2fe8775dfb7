"""The multi-host step channel in one process: a follower that replays what a leader sent
ends with the same KV pool, bit for bit (async steps, preemption, forks, prompt logprobs;
the slow tier), and the channel's rules."""

from __future__ import annotations

import types

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.parallel.step_channel import StepChannel, check_followable, follow, lead

ARGS = dict(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=12,
            attention_backend="xla", enable_prefix_caching=True)


class Loopback(StepChannel):
    """A channel whose broadcasts go to (leader) or come from (follower) a list."""

    def __init__(self, wire: list, leader: bool):
        super().__init__()
        self.is_leader, self.wire = leader, wire

    def _broadcast(self, buf):
        if self.is_leader:
            self.wire.append(buf.copy())
            return buf
        got = self.wire.pop(0)
        assert got.shape == buf.shape and got.dtype == buf.dtype  # what every process passes
        return got


def record_samples(engine) -> list:
    """The sampled ids of every step the engine's runner launches, as host arrays."""
    samples, launch = [], engine.runner.launch

    def recording(*args, **kwargs):
        res = launch(*args, **kwargs)
        samples.append(np.asarray(res[1]))  # i32[max_rows]
        return res

    engine.runner.launch = recording
    return samples


@pytest.mark.slow
def test_follower_replays_the_leader(tiny_model_dir, monkeypatch):
    from jaxserve.runner.model_runner import ModelRunner

    # Pure-decode steps (and warm-up's decode pass) take the decode program, as on the
    # Pallas backend (the XLA path computes the same with the flag set).
    monkeypatch.setattr(ModelRunner, "is_decode_step", lambda self, out, num_tokens, num_rows:
                        num_tokens == num_rows and all(s.num_new_tokens == 1
                                                       for s in out.scheduled))
    leader = LLM(tiny_model_dir, warmup=False, **ARGS)
    want = record_samples(leader.engine)
    wire: list = []
    channel = lead(leader.engine)
    channel.__class__, channel.is_leader, channel.wire = Loopback, True, wire
    leader.engine.warmup()  # sent as a message too
    leader.engine.async_scheduling = True
    prompts = [f"Request {i}: " + "tell me a long story about the sea " * (4 + i % 3)
               for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=40),
              SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=16),  # forks: copies
              SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2)]
    outs = leader.generate(prompts, [params[i % 3] for i in range(6)], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    assert leader.get_metrics()["jaxserve:num_preemptions"] > 0  # 12 pages cannot hold all
    channel.close()
    messages = [message(wire, i) for i in range(1, len(wire), 2)]
    assert [m[0] for m in messages[:2]] == ["warmup", "step"]  # warm-up is one message
    assert {"plans", "stop"} <= {m[0] for m in messages}
    steps = [m[1] for m in messages if m[0] == "step"]
    assert any(inputs.decode_only for inputs, _, _ in steps)
    assert any(prev is not None for _, _, prev in steps), [(s, p) for _, s, p in steps]

    follower = LLM(tiny_model_dir, warmup=False, **ARGS)
    got = record_samples(follower.engine)
    handled = follow(follower.engine, Loopback(wire, leader=False))
    assert handled == len(messages) and not wire
    # Every step computed the same samples (a skipped copy or a wrong placeholder source
    # would change what later steps read), and the pools end equal.
    assert len(got) == len(want) > 20
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert np.array_equal(np.asarray(follower.engine.runner.kv_pages),
                          np.asarray(leader.engine.runner.kv_pages))


def message(wire: list, i: int) -> tuple:
    """The (kind, payload) of the message whose body is `wire[i]`."""
    import pickle
    import zlib

    n = int(wire[i - 1][0])
    return pickle.loads(zlib.decompress(wire[i].view(np.uint8)[:n].tobytes()))


def test_channel_rules():
    channel = StepChannel()  # one process: this is process 0
    assert channel.is_leader
    follower = StepChannel()
    follower.is_leader = False
    with pytest.raises(RuntimeError, match="only process 0"):
        follower.send("step")
    def engine(speculator=None, data_parallel_size=1):
        parallel = types.SimpleNamespace(data_parallel_size=data_parallel_size)
        return types.SimpleNamespace(speculator=speculator, runner=None,
                                     config=types.SimpleNamespace(parallel=parallel))

    with pytest.raises(ValueError, match="draft model"):
        check_followable(engine(types.SimpleNamespace(own_device_calls=True)))
    check_followable(engine(  # an n-gram speculator proposes on the host
        types.SimpleNamespace(own_device_calls=False)))
    check_followable(engine())
    with pytest.raises(ValueError, match="data_parallel_size > 1 is single-host"):
        check_followable(engine(data_parallel_size=2))


def test_unknown_message_is_an_error(tiny_model_dir):
    wire: list = []
    sender = Loopback(wire, leader=True)
    sender.send("reboot")
    engine = types.SimpleNamespace(speculator=None, runner=None, config=types.SimpleNamespace(
        parallel=types.SimpleNamespace(data_parallel_size=1)))
    with pytest.raises(ValueError, match="unknown device call 'reboot'"):
        follow(engine, Loopback(wire, leader=False))
