"""The runner's kept sampling rows equal `build_sampling_metadata` built from scratch, step by
step: requests joining, output deltas, release, preemption and resume, forks, proposals."""

import dataclasses

import numpy as np
import pytest

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.request import Request
from jaxserve.runner.sampling_rows import SamplingRows
from jaxserve.sample.metadata import RowSpec, SamplingMetadata, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams as SP
from jaxserve.structured.grammar import bitmask_width

V, EOS = 64, 2


def with_bad_words(params: SP, seqs: list[list[int]]) -> SP:
    """`params` with bad words already tokenized (what the input processor sets)."""
    params = params.clone()
    params.bad_words_token_ids = seqs
    return params


MIXED = {
    "greedy": SP(temperature=0.0),
    "top_p": SP(temperature=0.8, top_p=0.9, seed=5),
    "top_k": SP(temperature=1.0, top_k=7, min_p=0.05),
    "big_k": SP(temperature=1.0, top_k=1000),  # k >= V: off
    "penalties": SP(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.2,
                    repetition_penalty=1.3),
    "presence": SP(temperature=0.0, presence_penalty=-0.4),
    "min_tokens": SP(temperature=0.9, min_tokens=3, stop_token_ids=[9, 11]),
    "bad_words": with_bad_words(SP(temperature=0.0, min_tokens=1), [[4], [5, 6]]),
    "bias": SP(temperature=0.0, logit_bias={3: 5.0, 8: -2.5}, logprobs=2),
    "allowed": SP(temperature=0.6, allowed_token_ids=[1, 3, 5, 7], logprobs=0),
    "prompt_lp": SP(temperature=0.0, prompt_logprobs=1),
}


def make(rid, params, prompt=(10, 11, 12, 13, 14), seeds=(77,)):
    return Request(rid, prompt, sampling_params=params, seeds=seeds)


def entry(req, num_samples=1, spec=(), start_pos=None, num_tokens=1):
    tokens = [1] * num_tokens + list(spec)
    start = req.num_tokens - num_tokens if start_pos is None else start_pos
    return ScheduledRequest(req.request_id, tokens, start, [], num_samples,
                            req.num_output_tokens, len(spec), pages_from=0)


def step(entries, reqs, released=()):
    return SchedulerOutput(entries, released_request_ids=list(released),
                           requests={r.request_id: r for r in reqs})


def oracle(out: SchedulerOutput, num_rows: int, inert=()) -> SamplingMetadata:
    """The rows as the engine built them from its Python objects before the store."""
    rows = []
    for s in out.scheduled:
        req = out.requests[s.request_id]
        for k in range(s.num_samples + s.num_spec_tokens):
            if s.request_id in inert:
                rows.append(RowSpec(SP(temperature=0.0), (), (), 0, 0))
                continue
            seed = req.seeds[k] if s.num_samples > 1 else req.seeds[req.sample_index]
            history = [*req.output_token_ids, *s.spec_token_ids[:k]] if k and \
                s.num_spec_tokens else req.output_token_ids
            counter = s.sampling_counter + (k if s.num_spec_tokens else 0)
            rows.append(RowSpec(req.sampling_params, req.prompt_token_ids, history, seed,
                                counter))
    return build_sampling_metadata(rows, num_rows, V, eos_token_id=EOS)


def assert_same(got: SamplingMetadata, want: SamplingMetadata):
    for f in dataclasses.fields(SamplingMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name


def gather(rows, out, num_rows=16, **kw):
    md, failed = rows.gather(out, num_rows, lambda r: r.sampling_params, **kw)
    return md, failed


def test_rows_written_once_then_decoded_by_deltas_equal_the_oracle():
    rows = SamplingRows(V, EOS, num_rows=2)  # grows past its first rows
    reqs = [make(name, p, seeds=(100 + i,)) for i, (name, p) in enumerate(MIXED.items())]
    rng = np.random.default_rng(0)
    for _ in range(6):
        out = step([entry(r) for r in reqs], reqs)
        md, failed = gather(rows, out)
        assert not failed
        assert_same(md, oracle(out, 16))
        for r in reqs:  # what the scheduler appends after the step
            r.append_output_token_ids(int(rng.integers(V)))
    assert rows.num_kept == len(reqs)
    # a step of a few of them, in another order: the same rows, gathered
    some = [reqs[4], reqs[0], reqs[7]]
    reqs[7].append_output_token_ids(5)  # completes the bad word [5, 6]'s head
    out = step([entry(r) for r in some], some)
    assert_same(gather(rows, out, 4)[0], oracle(out, 4))
    assert gather(rows, out, 4)[0].banned_token_ids[2].tolist()[:2] == [4, 6]


def test_greedy_only_steps_carry_no_optional_arrays():
    rows = SamplingRows(V, EOS)
    reqs = [make(f"g{i}", SP(temperature=0.0)) for i in range(3)]
    md, _ = gather(rows, step([entry(r) for r in reqs], reqs), 4)
    assert md.all_greedy and not md.needs_filtering and not md.needs_logprobs
    assert md.output_token_ids is None and md.banned_token_ids is None
    assert md.bias_token_ids is None and md.token_bitmask is None


def test_release_frees_rows_and_a_new_request_reuses_them_clean():
    rows = SamplingRows(V, EOS, num_rows=2)
    a, b = make("a", MIXED["bias"]), make("b", MIXED["penalties"])
    a.append_output_token_ids([3, 4])
    gather(rows, step([entry(a), entry(b)], [a, b]))
    total = rows.num_free + rows.num_kept
    c = make("c", SP(temperature=0.0))
    out = step([entry(c)], [c], released=["a", "b", "unknown"])
    assert_same(gather(rows, out, 2)[0], oracle(out, 2))
    assert rows.num_kept == 1 and rows.num_free + rows.num_kept == total
    # the same step again (the runner's own release) frees nothing more
    rows.release(out)
    assert rows.num_kept == 1


def test_preempted_request_is_rewritten_on_resume_with_its_output_so_far():
    rows = SamplingRows(V, EOS)
    a = make("a", MIXED["penalties"])
    a.append_output_token_ids([5, 6])
    gather(rows, step([entry(a)], [a]))
    # preempted (its row released), then it comes back with more output
    gather(rows, step([], [], released=["a"]))
    assert rows.num_kept == 0
    a.append_output_token_ids([7])
    out = step([entry(a, start_pos=0, num_tokens=a.num_tokens)], [a])
    assert_same(gather(rows, out)[0], oracle(out, 16))


def test_a_new_request_under_a_reused_id_gets_its_own_row():
    rows = SamplingRows(V, EOS)
    old = make("x", MIXED["penalties"])
    old.append_output_token_ids([1, 2, 3])
    gather(rows, step([entry(old)], [old]))
    new = make("x", MIXED["top_k"], seeds=(9,))  # the old one ended; its release is late
    out = step([entry(new)], [new])
    assert_same(gather(rows, out)[0], oracle(out, 16))
    assert rows.num_kept == 1
    # released and taken again in one step: the runner's own release of that step (in
    # `apply_kv_changes`, after the gather) keeps the new row
    again = make("x", MIXED["penalties"], seeds=(3,))
    out = step([entry(again)], [again], released=["x"])
    assert_same(gather(rows, out)[0], oracle(out, 16))
    rows.release(out)
    assert rows.slot_of.keys() == {"x"}
    assert_same(gather(rows, step([entry(again)], [again]))[0], oracle(out, 16))


def test_fan_out_rows_take_each_completions_seed_then_children_their_own():
    rows = SamplingRows(V, EOS)
    params = SP(temperature=1.0, n=3, presence_penalty=0.3)
    parent = make("p", params, seeds=(11, 22, 33))
    out = step([entry(parent, num_samples=3)], [parent])
    md, _ = gather(rows, out)
    assert_same(md, oracle(out, 16))
    assert md.seeds[:3].tolist() == [11, 22, 33]
    parent.append_output_token_ids(4)
    kids = [parent.fork(f"p#{i}") for i in (1, 2)]
    for i, kid in enumerate(kids, 1):
        kid.sample_index = i
        kid.output_token_ids[-1] = 40 + i
    fam = [parent, *kids]
    out = step([entry(r) for r in fam], fam)
    md, _ = gather(rows, out)
    assert_same(md, oracle(out, 16))
    assert md.seeds[:3].tolist() == [11, 22, 33]


def test_proposal_rows_count_and_see_the_proposals_before_them():
    rows = SamplingRows(V, EOS)
    reqs = [make("pen", MIXED["penalties"]), make("bad", MIXED["bad_words"]),
            make("min", MIXED["min_tokens"]), make("plain", MIXED["top_p"])]
    for r in reqs:
        r.append_output_token_ids([8, 9])
    out = step([entry(r, spec=[5, 6, 4]) for r in reqs[:3]] + [entry(reqs[3], spec=[1])],
               reqs)
    md, _ = gather(rows, out)
    assert_same(md, oracle(out, 16))
    assert md.counters[:4].tolist() == [2, 3, 4, 5]


def test_a_shorter_output_cuts_the_kept_history_back():
    """Beam search pops a token and appends another: the kept buffer follows."""
    rows = SamplingRows(V, EOS)
    a = make("a", MIXED["penalties"])
    a.append_output_token_ids([1, 2, 3])
    gather(rows, step([entry(a)], [a]))
    a.output_token_ids.pop()
    out = step([entry(a)], [a])
    assert_same(gather(rows, out)[0], oracle(out, 16))
    a.append_output_token_ids([30, 31])
    out = step([entry(a)], [a])
    assert_same(gather(rows, out)[0], oracle(out, 16))


def test_prefill_chunks_join_without_rows_and_hand_built_entries_are_inert():
    rows = SamplingRows(V, EOS)
    a, b = make("a", MIXED["top_p"]), make("b", MIXED["bias"])
    chunk = ScheduledRequest("a", [10, 11], 0, [], 0, pages_from=0)  # samples nothing
    loose = ScheduledRequest("w", [1], 0, [3], 1)  # warm-up style: no Request object
    out = step([chunk, entry(b), loose], [a, b])
    md, failed = gather(rows, out, 4)
    assert not failed and rows.num_kept == 2
    want = build_sampling_metadata(
        [RowSpec(b.sampling_params, seed=77), RowSpec(SP(temperature=0.0), seed=0)], 4, V,
        eos_token_id=EOS)
    assert_same(md, want)


def test_prompt_targets_are_the_next_prompt_tokens_of_rows_that_asked():
    rows = SamplingRows(V, EOS)
    lp = make("lp", MIXED["prompt_lp"], prompt=(20, 21, 22, 23, 24))
    plain = make("plain", MIXED["greedy"])
    first = ScheduledRequest("lp", [20, 21, 22], 0, [], 0, pages_from=0)
    out = step([entry(plain), first], [plain, lp])
    gather(rows, out)
    got = rows.prompt_targets(out, np.array([0, 1, 4]))
    assert got.tolist() == [-1, 21, 22, 23]
    last = ScheduledRequest("lp", [23, 24], 3, [], 1, pages_from=0)
    out = step([last], [lp])
    assert rows.prompt_targets(out, np.array([0, 2])).tolist() == [24, -1]
    done = ScheduledRequest("lp", [24], 4, [], 1, pages_from=0)  # past the prompt
    assert rows.prompt_targets(step([done], [lp]), np.array([0, 1])) is None
    only_plain = step([entry(plain)], [plain])
    assert rows.prompt_targets(only_plain, np.array([0, 1])) is None
    rows.release(step([], [], released=["lp"]))  # its prompt goes with its row
    assert rows.prompt_targets(step([first], [lp]), np.array([0, 3])) is None


def test_bitmasks_go_to_their_rows_and_free_rows_allow_everything():
    rows = SamplingRows(V, EOS)
    a, b = make("a", MIXED["greedy"]), make("b", MIXED["top_p"])
    mask = np.zeros(bitmask_width(V), np.int32)
    mask[0] = 0b1010
    out = step([entry(a), entry(b)], [a, b])
    md, _ = gather(rows, out, 4, masks={1: mask})
    want = build_sampling_metadata([RowSpec(a.sampling_params, seed=77),
                                    RowSpec(b.sampling_params, seed=77, token_bitmask=mask)],
                                   4, V, eos_token_id=EOS)
    assert_same(md, want)


def test_a_row_that_cannot_be_written_fails_its_request_alone():
    rows = SamplingRows(V, EOS)
    good, bad = make("good", MIXED["top_k"]), make("bad", MIXED["penalties"], seeds=(None,))
    bad.append_output_token_ids([3, 4])  # its inert row counts from 0 all the same
    out = step([entry(bad), entry(good)], [bad, good])
    md, failed = gather(rows, out, 4)
    assert list(failed) == ["bad"] and "seed" in str(failed["bad"])
    assert_same(md, oracle(out, 4, inert={"bad"}))
    assert rows.num_kept == 1

    def broken(req):
        raise RuntimeError("no state")

    other = make("other", MIXED["greedy"])
    md, failed = rows.gather(step([entry(other), entry(good)], [other, good]), 4, broken)
    assert list(failed) == ["other"]  # "good" was written before: not read again
    # a request the engine already failed this step is inert too
    md, failed = gather(rows, out, 4, inert={"good"})
    assert list(failed) == ["bad"]
    assert_same(md, oracle(out, 4, inert={"bad", "good"}))


def test_bad_steps_are_refused_naming_the_problem():
    rows = SamplingRows(V, EOS)
    reqs = [make(f"r{i}", MIXED["greedy"]) for i in range(3)]
    with pytest.raises(ValueError, match="num_rows_padded=2 is smaller than the 3 rows"):
        gather(rows, step([entry(r) for r in reqs], reqs), 2)
    with pytest.raises(ValueError, match="row 0: token_bitmask has shape"):
        gather(rows, step([entry(reqs[0])], reqs[:1]), 2, masks={0: np.zeros(3, np.int32)})
